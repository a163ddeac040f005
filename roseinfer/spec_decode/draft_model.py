"""The draft-model proposer: a small model with the target's tokenizer guesses k tokens, one at a time.

The draft is a real model with a real paged KV cache of its own (a `BlockSpaceManager`, a `KVCache`,
a `ModelRunner`: the same classes as the target's), so each of its k forwards is one decode step:

    target tokens        t0 .. t40 t41                       (t41 has no K/V in the target's cache yet)
    draft cache          t0 .. t38                            (what it computed last step and still holds)
    round 1              feed t39 t40 t41 -> d1               catch up, then the first guess
    round 2              feed d1          -> d2
    round k              feed d(k-1)      -> dk               (dk is proposed but never fed)

After the target has verified, some guesses are rejected. The draft notices on the next call: its cache
holds K/V for its own guesses, and only the guesses the target kept (they are now the request's
tokens) stay valid; the rest of its table is trimmed before it catches up again.

For a request that samples, each guess is drawn from the draft's own filtered distribution q (the
request's temperature, top-k and top-p) with the request's generator, and q is kept: the rejection
sampler needs q(d) to accept d with probability min(1, p(d) / q(d)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roseinfer.block_manager import BlockSpaceManager
from roseinfer.kv_cache import KVCache
from roseinfer.loader import load_model
from roseinfer.model_runner import ModelRunner
from roseinfer.sampling import SamplingParams, draw, filtered_probs
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.session import InferenceSession
from roseinfer.spec_decode import max_spec_tokens


@dataclass(eq=False)
class DraftSequence:
    """The draft's view of one request: the fields a `ModelRunner` reads from a sequence."""

    request_id: str
    tokens: list[int]  # the request's tokens, then this step's guesses
    params: SamplingParams
    generator: torch.Generator
    num_computed_tokens: int = 0  # tokens whose K/V are in the draft's cache
    num_real: int = 0  # tokens[:num_real] are the request's own; the rest are guesses
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each guess [V] (sampling requests)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class DraftModelProposer:
    def __init__(self, engine, model: str, k: int, num_blocks: int):
        """`engine`: the target's InferenceEngine (device, dtype, attention backend, block size);
        `model`: the draft's directory; `num_blocks`: the draft's KV pool, in blocks (the target's count:
        the draft holds the same tokens, and its blocks are smaller)."""
        self.draft, _ = load_model(model, engine.device, engine.dtype)
        target, draft = engine.config, self.draft.config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
                f"({target.vocab_size}): a draft must share the target's tokenizer"
            )
        if draft.n_positions < target.n_positions:
            raise ValueError(
                f"the draft model's context ({draft.n_positions}) is shorter than the target's ({target.n_positions})"
            )
        self.k = k
        self.block_manager = BlockSpaceManager(engine.block_size, num_blocks)
        self.block_manager.kv_cache = KVCache(draft, num_blocks, engine.block_size, engine.dtype, engine.device)
        self.runner = ModelRunner(self.draft, self.block_manager.kv_cache, engine.attn_backend, engine.device)
        self.seqs: dict[str, DraftSequence] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[InferenceSession]) -> None:
        bm = self.block_manager
        for rid in set(self.seqs) - {s.request_id for s in seqs}:  # finished, preempted, or not decoding
            self.free(rid)
        todo: list[tuple[InferenceSession, DraftSequence, int]] = []
        for seq in seqs:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            k = max_spec_tokens(seq, self.k)
            if k:
                todo.append((seq, self._sync(seq), k))
        for step in range(max((k for *_, k in todo), default=0)):
            batch = [d for _, d, k in todo if step < k and d.num_tokens - d.num_real == step]  # still guessing
            sched = SchedulerOutput([], {}, bm.block_tables)
            for d in batch:
                n = d.num_tokens - d.num_computed_tokens  # the catch-up tokens, or the latest guess
                if bm.allocate_slots(d.request_id, n):
                    sched.scheduled.append(d)
                    sched.num_scheduled_tokens[d.request_id] = n
            if not sched.scheduled:
                break  # the draft's pool is full: propose what we have
            inp = self.runner.prepare_inputs(sched)
            logits = self.runner.compute_logits(inp)  # [S, V], in inp.sampling's order
            guesses = self._guess(logits, inp.sampling)
            for d, (token, q) in zip(inp.sampling, guesses, strict=True):
                d.num_computed_tokens = d.num_tokens
                d.tokens.append(token)
                if q is not None:
                    d.probs.append(q)
        for seq, d, _ in todo:
            seq.spec_token_ids = d.tokens[d.num_real :]
            seq.spec_draft_probs = torch.stack(d.probs) if d.probs else None  # [k, V]

    def free(self, request_id: str) -> None:
        self.block_manager.free(request_id)
        self.seqs.pop(request_id, None)

    def _sync(self, seq: InferenceSession) -> DraftSequence:
        """The draft's sequence for a request, its cache trimmed to the tokens it still shares with it: its
        guesses from last step that the target accepted are now the request's tokens, the rest are not."""
        d = self.seqs.get(seq.request_id)
        if d is None:
            d = self.seqs[seq.request_id] = DraftSequence(seq.request_id, [], seq.params, seq.generator)
        valid = d.num_real
        theirs = seq.token_ids(valid, min(seq.num_tokens, d.num_tokens))
        while valid - d.num_real < len(theirs) and d.tokens[valid] == theirs[valid - d.num_real]:
            valid += 1
        # at least the last token is fed again: its logits give the first guess
        d.num_computed_tokens = min(d.num_computed_tokens, valid, seq.num_tokens - 1)
        if d.request_id in self.block_manager.block_tables:
            self.block_manager.trim(d.request_id, d.num_computed_tokens)
        d.tokens[valid:] = seq.token_ids(valid, seq.num_tokens)
        d.num_real, d.probs = len(d.tokens), []
        return d

    def _guess(self, logits: torch.Tensor, seqs: list[DraftSequence]) -> list[tuple[int, torch.Tensor | None]]:
        """The draft's next token for each sequence: its argmax for greedy requests; for sampling requests a
        draw from q, the draft's distribution under the request's own temperature / top-k / top-p."""
        out: list[tuple[int, torch.Tensor | None]] = [(t, None) for t in logits.argmax(dim=-1).tolist()]
        rows = [i for i, d in enumerate(seqs) if not d.params.greedy]
        if rows:
            q = filtered_probs(logits[rows], [seqs[i].params for i in rows])  # [R, V]
            u = torch.cat([torch.rand(1, generator=seqs[i].generator, device=q.device) for i in rows])  # [R]
            for i, token, row in zip(rows, draw(q, u).tolist(), q, strict=True):
                out[i] = (token, row)
        return out
