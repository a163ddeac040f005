"""The model runner: one SchedulerOutput in, ONE forward pass, the sampled tokens out.

Every request's new tokens this step are laid end to end, decodes first, as one flat batch
(no padding, no [B, T] rectangle):

    request      A (decode)  B (decode)  C (prompt chunk: tokens 32..79 of 100)
    input_ids    a37         b15         c32 c33 ... c79                       [N] = [50]
    positions    37          15          32  33  ... 79                        [N]
    slot_mapping A's slot    B's slot    C's slots for positions 32..79        [N]
    query_start_loc  [0, 1, 2, 50]       request b's rows: query_start_loc[b] .. [b + 1] - 1
    seq_lens         [38, 16, 80]        tokens each request attends to after this step
    block_tables     [B, max_blocks]     one row per request, padded with 0

Every linear layer, LayerNorm and MLP runs once over all N rows; only attention looks at the
requests separately (through `AttentionMetadata`). The LM head runs only on the rows that need a
next token: the last new token of each request that reaches the end of its sequence (A, B here;
not C, whose prompt goes on next step).

Stage 14: a request that verifies k draft tokens brings its last token and the drafts (1 + k rows), and
gets logits on all of them: row i scores draft i + 1, the last row the token after the last draft. The
rejection sampler (roseinfer/spec_decode/rejection_sampler.py) turns them into the tokens it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roseinfer.attention import AttentionBackend, AttentionMetadata, GatherBuffer
from roseinfer.kv_cache import KVCache, swap_blocks
from roseinfer.model import GPT2
from roseinfer.sampling import BeamSearchParams, sample
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.session import InferenceSession
from roseinfer.spec_decode.rejection_sampler import rejection_sample


@dataclass
class ModelRunnerOutput:
    """What a step produced, per sequence id."""

    sampled: dict[str, int] = field(default_factory=dict)  # the next token
    logprobs: dict[str, float] = field(default_factory=dict)  # stage 11: its log-probability (n > 1)
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)  # stage 11: a beam's log-softmax [V]
    # stage 14: a speculating request's new tokens: the drafts it accepted, then one of the target's
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelInput:
    """The tensors of one step, built by `ModelRunner.prepare_inputs`."""

    input_ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] their positions in their sequences
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] the row of each sampling request's last new token
    sampling: list[InferenceSession]  # the S requests that get a next token, in logits_indices order
    # stage 14: drafts each sampling request verifies (its k rows come just before its last row in logits_indices)
    spec_token_ids: list[list[int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: GPT2,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        use_kv_cache: bool = True,
        host_kv_cache: KVCache | None = None,
    ):
        self.model, self.kv_cache, self.backend, self.device = model, kv_cache, backend, device
        self.host_kv_cache = host_kv_cache  # stage 12: the swap pool in host memory
        self.block_size = kv_cache.block_size
        self.use_kv_cache = use_kv_cache  # False: the naive stage-01 loop (whole sequence, no cache)
        self.gather_buffer = GatherBuffer()  # scratch reused by every step (see roseinfer/attention/sdpa.py)

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests into one batch, decodes first (see the module docstring)."""
        n_new = sched.num_scheduled_tokens
        # decodes first, longest context first (attention backends may batch runs of similar length), then chunks
        reqs = sorted(sched.scheduled, key=lambda r: (n_new[r.request_id] > 1, -r.num_computed_tokens))
        counts = [n_new[r.request_id] for r in reqs]  # [B] new tokens per request
        starts = [r.num_computed_tokens for r in reqs]  # [B] position of each request's first new token
        seq_lens = [s + n for s, n in zip(starts, counts, strict=True)]
        query_start_loc = [0]
        for n in counts:
            query_start_loc.append(query_start_loc[-1] + n)
        spec = [sched.scheduled_spec_decode_tokens.get(r.request_id, []) for r in reqs]  # stage 14: drafts
        token_ids = []
        for r, s, n, drafts in zip(reqs, starts, counts, spec, strict=True):
            token_ids += r.token_ids(s, s + n - len(drafts)) + drafts  # a speculating request: last token + drafts
        tables = [sched.block_tables[r.request_id] for r in reqs]
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [B, W]

        # Per token: which request it belongs to, then its position and slot, without a Python loop.
        req_of_token = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(counts))  # [N]
        first_row = torch.tensor(query_start_loc[:-1])[req_of_token]  # [N] row of the request's first token
        positions = torch.arange(len(token_ids)) - first_row + torch.tensor(starts)[req_of_token]  # [N]
        blocks = block_tables[req_of_token, positions // self.block_size].long()  # [N] physical block
        slot_mapping = blocks * self.block_size + positions % self.block_size  # [N]

        sampling = [i for i, r in enumerate(reqs) if seq_lens[i] == r.num_tokens + len(spec[i])]  # reaches the end
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            num_decodes=sum(n == 1 for n in counts),
            max_query_len=max(counts),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            backend=self.backend,
            gather_buffer=self.gather_buffer,
        )
        if self.backend is not None and self.backend.prepare is not None:
            meta.plan = self.backend.prepare(meta, self.block_size)  # once per step, for every layer
        rows, last = [], {}  # each sampling request's last new token; a speculating one's k rows before it too
        for i in sampling:
            rows += range(query_start_loc[i + 1] - 1 - len(spec[i]), query_start_loc[i + 1])  # (stage 14)
            last[reqs[i].request_id] = rows[-1]
        samplers = [reqs[i] for i in sampling]
        for parent, child in sched.forks:  # stage 11: a forked child samples from its parent's row
            rows.append(last[parent.request_id])
            samplers.append(child)
        return ModelInput(
            input_ids=torch.tensor(token_ids, device=dev),
            positions=positions.to(dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            sampling=samplers,
            spec_token_ids=[spec[i] for i in sampling] + [[] for _ in sched.forks],
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return the sampled token of every request that reached its end (and, stage 11,
        the log-probabilities that beam search and n > 1 need). The caller (the scheduler) then advances
        every request's num_computed_tokens."""
        self.move_blocks(sched)
        if not sched.scheduled:
            return ModelRunnerOutput()
        inp = self.prepare_inputs(sched)
        if not inp.sampling:
            self.compute_logits(inp)  # a step of prompt chunks only: fill the cache, sample nothing
            return ModelRunnerOutput()
        logits = self.compute_logits(inp)  # [rows, V]
        if not any(inp.spec_token_ids):
            return self._sample(logits, inp.sampling)
        return self._verify(logits, inp)

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """The block copies a step asks for, in every layer, before anything writes (see SchedulerOutput)."""
        if sched.blocks_to_swap_out:  # stage 12: even in a step that runs nothing, before the blocks are reused
            swap_blocks(self.kv_cache.layers, self.host_kv_cache.layers, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            swap_blocks(self.host_kv_cache.layers, self.kv_cache.layers, sched.blocks_to_swap_in)
        if sched.blocks_to_copy:  # stage 11: copy-on-write
            copies = torch.tensor(sched.blocks_to_copy, dtype=torch.long, device=self.device)  # [P, 2]
            self.backend.copy_blocks(self.kv_cache.layers, copies)

    def compute_logits(self, inp: ModelInput) -> torch.Tensor:
        """The forward pass: every new token's K/V goes into the cache; returns the logits of the
        `logits_indices` rows only ([S, V])."""
        if self.use_kv_cache:
            hidden = self.model.forward_paged(inp.input_ids, inp.positions, self.kv_cache.layers, inp.attn_metadata)
            return self.model.compute_logits(hidden[inp.logits_indices])  # [S, V]: only the rows that sample
        # the naive loop: each sampling request's whole sequence again, for its last logits
        seqs = [torch.tensor([r.token_ids(0, r.num_tokens)], device=self.device) for r in inp.sampling]
        if not seqs:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return torch.cat([self.model(ids)[:, -1] for ids in seqs])  # [S, V]

    def _verify(self, logits: torch.Tensor, inp: ModelInput) -> ModelRunnerOutput:
        """Stage 14: a step with speculating requests. Their k + 1 rows go to the rejection sampler; every
        other request samples from its one row as usual."""
        spec, spec_rows, plain, plain_rows, row = [], [], [], [], 0
        for seq, drafts in zip(inp.sampling, inp.spec_token_ids, strict=True):
            if drafts:
                spec.append((seq, drafts))
                spec_rows += range(row, row + len(drafts) + 1)
            else:
                plain.append(seq)
                plain_rows.append(row)
            row += len(drafts) + 1
        out = self._sample(logits[plain_rows], plain) if plain else ModelRunnerOutput()
        tokens = rejection_sample(logits[spec_rows], [d for _, d in spec], [_draft_probs(s, len(d)) for s, d in spec],
                                  [s.params for s, _ in spec], [s.generator for s, _ in spec])  # fmt: skip
        out.spec_sampled = {s.request_id: t for (s, _), t in zip(spec, tokens, strict=True)}
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[InferenceSession]) -> ModelRunnerOutput:
        """A token for each sampling sequence; a beam gets its whole next-token log-softmax instead (stage 11),
        and a sequence of a group with n > 1 also the log-probability of its token."""
        out = ModelRunnerOutput()
        beam = [i for i, s in enumerate(seqs) if isinstance(s.params, BeamSearchParams)]
        if beam:
            logprobs = torch.log_softmax(logits[beam].float(), dim=-1).cpu()  # [beams, V]
            out.beam_logprobs = {seqs[i].request_id: row for i, row in zip(beam, logprobs, strict=True)}
        rest = sorted(set(range(len(seqs))) - set(beam))
        if not rest:
            return out
        logits, seqs = logits[rest] if beam else logits, [seqs[i] for i in rest]
        next_ids = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])  # [S]
        out.sampled = {s.request_id: t for s, t in zip(seqs, next_ids.tolist(), strict=True)}
        in_group = [i for i, s in enumerate(seqs) if s.params.n > 1]
        if in_group:  # cumulative_logprob of each of the n completions
            ids = next_ids[in_group][:, None]
            chosen = torch.log_softmax(logits[in_group].float(), dim=-1).gather(1, ids)[:, 0].tolist()
            out.logprobs = {seqs[i].request_id: lp for i, lp in zip(in_group, chosen, strict=True)}
        return out


def _draft_probs(seq: InferenceSession, k: int) -> torch.Tensor | None:
    """The draft model's q for the first k drafts the step verifies (the scheduler may have cut some)."""
    return None if seq.spec_draft_probs is None else seq.spec_draft_probs[:k]
