"""The draft-model proposer: a small model with the target's tokenizer guesses k tokens, one at a time.

The draft is a real model with a real paged KV cache: its own K/V tensors, but the target's block tables.
Block b of the target's pool and block b of the draft's pool hold the same tokens, so the draft needs no
block manager of its own: the scheduler books `num_speculative_tokens` slots past every decode
(`num_lookahead_tokens`), where the draft writes the K/V of its guesses. Each round is one forward:

    target tokens        t0 .. t40 t41                       (t41 just sampled)
    draft cache          t0 .. t38                            (what it computed last time and still holds)
    round 1              feed t39 t40 t41 -> d1               catch up, then the first guess
    round 2              feed d1          -> d2               (at position 42, a slot booked ahead)
    round k              feed d(k-1)      -> dk               (dk is proposed but never fed)

A guess is fed from the proposer's own list: the runner's token rows hold only the request's tokens, and the
proposer reads them without writing.

After the target has verified, some guesses are rejected. The draft's K/V for a guess stays valid only
if the guess is now the request's token at that position; the next call counts how many are, and catches
up from there. When a request's table changes (a swap-in, blocks given back), its draft K/V from that
block on are forgotten.

For a request that samples, each guess is drawn from the draft's own filtered distribution q (the
request's temperature, top-k and top-p) with the request's random stream, and q goes back with the guesses
(`DraftProposal.probs`); the runner keeps it until it verifies them: the rejection sampler needs q(d) to accept
d with probability min(1, p(d) / q(d)).
"""

from __future__ import annotations

import numpy as np
import torch

from roseinfer.attention import GatherBuffer
from roseinfer.config import EngineConfig
from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir
from roseinfer.sample.sampler import draw, filtered_probs, greedy_sample, uniforms
from roseinfer.spec_decode import DraftProposal, speculating_rows
from roseinfer.worker.kv_cache import KVCache
from roseinfer.worker.step_inputs import prepare_step


class DraftModelProposer:
    def __init__(self, config: EngineConfig, runner):
        mc, spec = config.model_config, config.speculative_config
        draft_dir = resolve_model_dir(spec.model)
        cfg = read_model_config(draft_dir)
        target = mc.hf_config
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({cfg.vocab_size} tokens) differs from the target's "
                f"({target.vocab_size}): a draft must share the target's tokenizer"
            )
        if cfg.max_position_embeddings < mc.max_model_len:
            raise ValueError(f"the draft model's context ({cfg.max_position_embeddings}) is shorter than the target's "
                             f"({mc.max_model_len})")  # fmt: skip
        self.k = spec.num_speculative_tokens
        self.model = load_model(draft_dir, cfg, runner.device, mc.dtype, linear_backend=mc.linear_backend)
        self.kv_cache = KVCache(cfg, runner.kv_cache.num_blocks, runner.block_size, mc.kv_cache_dtype, runner.device)
        self.gather_buffer = GatherBuffer()
        self.computed: dict[str, int] = {}  # request id -> tokens whose draft K/V are valid
        self.fed: dict[str, list[int]] = {}  # request id -> guesses fed past them last time (maybe now its tokens)

    def free(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.fed.pop(req_id, None)

    def invalidate(self, req_id: str, position: int) -> None:
        """The request's blocks changed from `position` on: the draft's K/V there are gone."""
        computed = self.computed.get(req_id)
        if computed is None:
            return
        if position <= computed:
            self.computed[req_id] = position
            self.fed.pop(req_id, None)
        elif req_id in self.fed:
            self.fed[req_id] = self.fed[req_id][: position - computed]

    @torch.inference_mode()
    def propose(self, runner, out) -> DraftProposal:
        input_batch, bs = runner.input_batch, runner.block_size
        todo = []  # (request id, row, guesses)
        for rid, row, k in speculating_rows(runner, out, self.k):
            n = int(input_batch.num_tokens[row])
            k = min(k, int(input_batch.block_table.num_blocks[row]) * bs - n + 1)  # a slot for every guess it feeds
            if k >= 1:
                todo.append((rid, row, k))
                self._sync(rid, row, input_batch)
        guesses: dict[str, list[int]] = {rid: [] for rid, _, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _ in todo}
        for j in range(max((k for *_, k in todo), default=0)):
            batch = [(rid, row) for rid, row, k in todo if j < k]
            ids = [rid for rid, _ in batch]
            rows = np.array([row for _, row in batch], dtype=np.int64)
            ends = input_batch.num_tokens[rows] + j  # round j feeds up to position n + j - 1
            starts = np.array([self.computed[r] for r in ids], dtype=np.int64) if j == 0 else ends - 1
            step = prepare_step(input_batch, ids, rows, starts, ends - starts, runner.backend, self.gather_buffer,
                                runner.to_device)  # fmt: skip
            input_ids = step.input_ids  # [N]
            if j:  # one token each: the guess of the round before, at position n + j - 1 (not in the token row)
                input_ids = runner.to_device(np.array([guesses[r][-1] for r in step.req_ids], dtype=np.int64))
            hidden = self.model.forward_paged(input_ids, step.positions, self.kv_cache.layers, step.attn_metadata)
            logits = self.model.compute_logits(hidden[runner.to_device(step.query_start_loc[1:] - 1)])  # [S, V]
            tokens, q = self._guess(logits, step.rows, input_batch)
            for i, rid in enumerate(step.req_ids):
                guesses[rid].append(int(tokens[i]))
                if q is not None and q[i] is not None:
                    probs[rid].append(q[i])
        for rid, row, k in todo:
            n = int(input_batch.num_tokens[row])
            self.computed[rid], self.fed[rid] = n, guesses[rid][: k - 1]  # d1 .. d(k-1) were fed
        draft_probs = {rid: torch.stack(q) for rid, q in probs.items() if q}  # [k, V] each
        return DraftProposal(guesses, draft_probs or None)

    def _sync(self, rid: str, row: int, input_batch) -> None:
        """How far the draft's K/V still match the request: its old guesses that are now the request's tokens."""
        valid, n = self.computed.get(rid, 0), int(input_batch.num_tokens[row])
        for guess in self.fed.pop(rid, []):
            if valid >= n - 1 or input_batch.token_ids[row, valid] != guess:
                break
            valid += 1
        self.computed[rid] = min(valid, n - 1)  # the last token is always fed: its logits give the first guess

    def _guess(self, logits: torch.Tensor, rows: np.ndarray, input_batch) -> tuple[np.ndarray, list | None]:
        """The draft's next token per row: its argmax for greedy requests; for sampling requests a draw from q,
        the draft's distribution under the request's own temperature / top-k / top-p."""
        sampling = input_batch.sampling_tensors(rows, logits.device)
        tokens = greedy_sample(logits.float()).cpu().numpy().copy()
        if sampling.all_greedy:
            return tokens, None
        sampled = np.flatnonzero(~(sampling.temperature.cpu().numpy() < 1e-5))
        q = filtered_probs(logits, sampling)  # [S, V]
        u = uniforms(1, sampled.tolist(), sampling.generators, q.device)[:, 0]  # [R]
        tokens[sampled] = draw(q[torch.from_numpy(sampled).to(q.device)], u).cpu().numpy()
        rows_q: list = [None] * len(rows)
        for i in sampled.tolist():
            rows_q[i] = q[i]
        return tokens, rows_q
