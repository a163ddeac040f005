"""The model runner: one SchedulerOutput in, ONE forward pass, the sampled tokens out.

    execute_model(scheduler_output)
      1. update the persistent batch with what changed   new rows, forks, finished rows, block-table tails,
                                                         num_computed_tokens (roseinfer/worker/input_batch.py)
      2. move blocks                                     swap out, swap in, copy-on-write
      3. build the step's tensors                        roseinfer/worker/step_inputs.py
      4. one forward over all N new tokens               every linear layer runs once on [N, C]; only
                                                         attention looks at requests separately
      5. the LM head on the rows that need a next token  the last new token of each request that reaches
                                                         the end of its sequence (not a prompt chunk that
                                                         goes on next step); a request verifying k drafts
                                                         brings k + 1 rows
      6. sample (roseinfer/sample/)                      the whole batch at once; verifying requests go to
                                                         the rejection sampler; a beam returns its top
                                                         2·beam_width tokens instead of a sample
      7. write the sampled tokens into the batch, propose drafts for the next step (speculative decoding)

The runner owns the model, the KV cache tensors (roseinfer/worker/kv_cache.py) and, on CUDA, the graphs of
decode steps (roseinfer/worker/cuda_graph.py). With tensor parallelism every rank runs the same steps on
its shard; only the driver (rank 0) computes logits and samples, and the others learn the sampled tokens
with the next step's message (`apply_sampled`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.attention import GatherBuffer, get_backend
from roseinfer.config import EngineConfig
from roseinfer.core.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from roseinfer.model_executor.loader import load_model
from roseinfer.sample.rejection_sampler import rejection_sample
from roseinfer.sample.sampler import sample
from roseinfer.sampling_params import SamplingParams
from roseinfer.worker.input_batch import InputBatch
from roseinfer.worker.kv_cache import KVCache, swap_blocks
from roseinfer.worker.step_inputs import StepInputs, prepare_step


@dataclass
class StepHandle:
    """A launched step: its output so far, and the plain rows' tokens (maybe still landing in host memory)."""

    out: ModelRunnerOutput
    plain: np.ndarray  # indices into out.req_ids of the requests that sampled one token
    rows: np.ndarray  # their rows in the input batch
    tokens: torch.Tensor | None  # [P] int64 on the host
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, device: torch.device | None = None):
        mc, cc = config.model_config, config.cache_config
        self.config = config
        self.device = device or mc.device
        self.tp_rank, self.tp_size = tp_rank, config.parallel_config.tensor_parallel_size
        self.is_driver = tp_rank == 0
        self.model = load_model(
            mc.model_dir, mc.hf_config, self.device, mc.dtype, tp_rank, self.tp_size, mc.linear_backend
        )
        self.backend = get_backend(mc.attention_backend, self.device)
        self.block_size = cc.block_size
        if cc.num_gpu_blocks is None:  # CUDA: what is left of the card's share once the weights are in
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cc.gpu_memory_utilization - (total - free))
            cc.num_gpu_blocks = max(1, budget // (mc.kv_bytes_per_token(self.tp_size) * cc.block_size))
        hf, dtype = mc.hf_config, mc.dtype
        self.kv_cache = KVCache(hf, cc.num_gpu_blocks, cc.block_size, dtype, self.device, tp_size=self.tp_size)
        self.host_kv_cache = (KVCache(hf, cc.num_cpu_blocks, cc.block_size, dtype, self.device, host=True,
                                      tp_size=self.tp_size) if cc.num_cpu_blocks else None)  # fmt: skip
        lookahead = config.scheduler_config.num_lookahead_tokens
        max_blocks = -(-(mc.max_model_len + lookahead) // cc.block_size) + 1
        self.input_batch = InputBatch(mc.max_model_len, max_blocks, cc.block_size, mc.vocab_size, self.device,
                                      capacity=max(64, config.scheduler_config.max_num_seqs))  # fmt: skip
        self.gather_buffer = GatherBuffer()  # scratch reused by every step (see roseinfer/attention/sdpa.py)
        self._cached_rows = np.zeros(0, dtype=np.int64)  # rows of the step's cached requests, in their order
        self.proposer = None
        if config.speculative_config is not None and self.is_driver:
            from roseinfer.spec_decode import make_proposer

            self.proposer = make_proposer(config, self)
        self.cuda_graphs = None
        if (self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton"
                and self.tp_size == 1):  # fmt: skip
            from roseinfer.worker.cuda_graph import CUDAGraphRunner

            self.cuda_graphs = CUDAGraphRunner(self, max_batch_size=config.scheduler_config.max_num_seqs)

    # ---- one step ----------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return every sampled token (None on a rank that does not sample)."""
        return self.finish_step(self.launch_step(so))

    @torch.inference_mode()
    def launch_step(self, so: SchedulerOutput) -> StepHandle | ModelRunnerOutput | None:
        """Everything up to the sampled tokens. On CUDA the kernels are only queued: the tokens are on their way
        to pinned host memory when this returns, and `finish_step` waits for them (async scheduling schedules
        the next step in between). On a CPU the work is done by the time this returns."""
        self._update_states(so)
        self.move_blocks(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        ib = self.input_batch
        ids = list(so.num_scheduled_tokens)
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        rows = self._cached_rows if ids == so.scheduled_cached_reqs.req_ids else ib.rows(ids)
        drafts = None
        if so.scheduled_spec_decode_tokens:  # the drafts go after the request's tokens, where they would be
            drafts = {}
            for rid, d in so.scheduled_spec_decode_tokens.items():
                row = ib.req_id_to_row[rid]
                n = int(ib.num_tokens[row])
                ib.token_ids[row, n : n + len(d)] = d
                drafts[rid] = len(d)
        step = prepare_step(
            ib, ids, rows, ib.num_computed_tokens[rows], counts, self.backend, self.gather_buffer, self.to_device
        )
        hidden = self._forward(step)
        if not self.is_driver:
            return None
        num_drafts = np.zeros(len(step.rows), dtype=np.int64)
        if drafts:
            num_drafts[:] = [drafts.get(r, 0) for r in step.req_ids]
        ends = step.seq_lens == ib.num_tokens[step.rows] + num_drafts  # reaches the end of its sequence
        pos = np.flatnonzero(ends)  # the requests that get tokens, in batch order
        forks = [f for f in so.forks if f.sample_now]
        if not len(pos) and not forks:
            return EMPTY_MODEL_RUNNER_OUTPUT  # prompt chunks only: the cache is filled, nothing to sample
        nrows = num_drafts[pos] + 1  # logits rows per request: 1, or k + 1 when verifying
        last = step.query_start_loc[pos + 1]
        first = np.repeat(last - nrows, nrows)
        logits_rows = first + np.arange(int(nrows.sum())) - np.repeat(np.cumsum(nrows) - nrows, nrows)
        every = len(pos) == len(step.rows)  # the usual decode step: every request gets a token
        req_ids = list(step.req_ids) if every else [step.req_ids[i] for i in pos]
        sample_rows = step.rows if every else step.rows[pos]
        if forks:  # n > 1: each child samples from its parent's last row, with its own random stream
            at = {r: i for i, r in enumerate(req_ids)}
            lrow = np.cumsum(nrows) - 1
            for f in forks:
                logits_rows = np.append(logits_rows, logits_rows[lrow[at[f.parent_id]]])
                req_ids.append(f.child_id)
                sample_rows = np.append(sample_rows, ib.req_id_to_row[f.child_id])
            nrows = np.append(nrows, np.ones(len(forks), dtype=np.int64))
        logits = self.model.compute_logits(hidden[self.to_device(logits_rows)])  # [rows, V]
        return self._sample(logits, req_ids, sample_rows, nrows, so)

    @torch.inference_mode()
    def finish_step(self, handle: StepHandle | ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        """Wait for a launched step's tokens, write them into the batch, propose the next drafts."""
        if not isinstance(handle, StepHandle):
            return handle
        out = handle.out
        if handle.tokens is not None:
            if handle.event is not None:
                handle.event.synchronize()
            tokens = handle.tokens.numpy()
            self.input_batch.append_token_column(handle.rows, tokens)
            if len(handle.plain) == len(out.req_ids):
                out.sampled_token_ids = [[t] for t in tokens.tolist()]
            else:
                for i, t in zip(handle.plain.tolist(), tokens.tolist(), strict=True):
                    out.sampled_token_ids[i] = [t]
        if self.proposer is not None:
            out.spec_token_ids = self.proposer.propose(self, out)
        return out

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """hidden states [N, C] of every new token; on CUDA a decode step replays a captured graph."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(step):
            return self.cuda_graphs.run(step)
        return self.model.forward_paged(step.input_ids, step.positions, self.kv_cache.layers, step.attn_metadata)

    def _sample(self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, nrows: np.ndarray,
                so: SchedulerOutput) -> StepHandle:  # fmt: skip
        """Turn the logits into tokens: the plain rows in one call of the sampler (their tokens come back through
        `finish_step`), verifying requests through the rejection sampler, beams into their top tokens."""
        ib = self.input_batch
        beam = ib.beam_topk[rows] > 0
        spec = nrows > 1
        plain = np.flatnonzero(~beam & ~spec)
        all_plain = len(plain) == len(req_ids)
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=None if all_plain else [[] for _ in req_ids])
        handle = StepHandle(out, plain, rows if all_plain else rows[plain], None, None)
        last_row = np.cumsum(nrows) - 1  # each request's last logits row
        if all_plain:
            handle.tokens, handle.event = self._sample_plain(logits, rows, req_ids, plain, out)
        elif len(plain):
            plain_logits = logits[self.to_device(last_row[plain])]
            handle.tokens, handle.event = self._sample_plain(plain_logits, rows[plain], req_ids, plain, out)
        if spec.any():
            self._verify(logits, req_ids, rows, nrows, np.flatnonzero(spec), so, out)
        for i in np.flatnonzero(beam).tolist():  # a beam: its best next tokens, for the beam search
            state = ib.requests[req_ids[i]]
            lp = torch.log_softmax(logits[int(last_row[i])].float(), dim=-1)  # [V]
            top = torch.topk(lp, min(state.beam_topk, lp.shape[0]))
            out.beam_logprobs[req_ids[i]] = (top.indices.tolist(), top.values.tolist())
        return handle

    def _sample_plain(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], plain: np.ndarray,
                      out: ModelRunnerOutput) -> tuple[torch.Tensor, torch.cuda.Event | None]:  # fmt: skip
        """One token per row from the sampler, on their way to the host (with the event that says they are there);
        the log-probability of each for requests with n > 1."""
        ib = self.input_batch
        t = ib.sampling_tensors(rows, logits.device)
        tokens = sample(logits, t)  # [S]
        want = np.flatnonzero(ib.needs_logprobs[rows])
        if len(want):
            idx = self.to_device(want)
            chosen = torch.log_softmax(logits[idx].float(), dim=-1).gather(1, tokens[idx][:, None])[:, 0]
            for i, lp in zip(want.tolist(), chosen.tolist(), strict=True):
                out.logprobs[req_ids[plain[i]]] = [lp]
        if tokens.device.type == "cpu":
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)  # the host does other work while this lands
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _verify(self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, nrows: np.ndarray,
                idx: np.ndarray, so: SchedulerOutput, out: ModelRunnerOutput) -> None:  # fmt: skip
        """Requests that verify drafts: their k + 1 rows each go to the rejection sampler."""
        ib = self.input_batch
        starts = np.cumsum(nrows) - nrows
        sel = np.concatenate([np.arange(starts[i], starts[i] + nrows[i]) for i in idx])
        ids = [req_ids[i] for i in idx]
        drafts = [so.scheduled_spec_decode_tokens[r] for r in ids]
        probs = []
        for r, d in zip(ids, drafts, strict=True):
            state = ib.requests[r]
            q = state.spec_draft_probs
            probs.append(None if q is None else q[: len(d)])
            state.spec_draft_probs = None  # used: the next drafts bring their own
        t = ib.sampling_tensors(rows[idx], logits.device)
        for i, tokens in zip(
            idx.tolist(), rejection_sample(logits[self.to_device(sel)], drafts, probs, t), strict=True
        ):
            out.sampled_token_ids[i] = tokens
            ib.append_tokens(int(rows[i]), tokens)

    # ---- the persistent batch ----------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's diffs: drop finished requests, add new ones and forks, update the rest."""
        ib = self.input_batch
        for rid in so.finished_req_ids:
            ib.remove_request(rid)
            if self.proposer is not None:
                self.proposer.free(rid)
        for new in so.scheduled_new_reqs:
            gen = self._generator(new.sampling_params, 0)
            ib.add_request(new.req_id, new.prompt_token_ids, new.sampling_params, new.block_ids,
                           new.num_computed_tokens, gen)  # fmt: skip
        for f in so.forks:
            params = ib.requests[f.parent_id].params
            ib.fork(f.parent_id, f.child_id, f.block_ids, self._generator(params, f.index))
        c = so.scheduled_cached_reqs
        self._cached_rows = rows = ib.rows(c.req_ids)
        if not c.req_ids:
            return
        ib.num_computed_tokens[rows] = c.num_computed_tokens
        bs = self.block_size
        for i, update in enumerate(c.new_block_ids):
            if update is not None:
                row = int(rows[i])
                ib.block_table.replace_from(row, *update)
                if self.proposer is not None:
                    self.proposer.invalidate(c.req_ids[i], update[0] * bs)  # a draft's K/V past the change are gone
        for i, tokens in enumerate(c.new_token_ids):
            if tokens:  # chosen by the beam search, not by our sampler
                ib.append_tokens(int(rows[i]), tokens)

    def apply_sampled(self, out: ModelRunnerOutput | None) -> None:
        """A rank that does not sample learns the driver's tokens of the previous step (tensor parallelism)."""
        if out is None:
            return
        ib = self.input_batch
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if tokens and rid in ib.req_id_to_row:
                ib.append_tokens(ib.req_id_to_row[rid], tokens)

    def _generator(self, params, index: int) -> torch.Generator | None:
        return params.make_generator(self.device, index) if isinstance(params, SamplingParams) else None

    def move_blocks(self, so: SchedulerOutput) -> None:
        """The block copies a step asks for, in every layer, before anything writes (see SchedulerOutput)."""
        if so.blocks_to_swap_out:  # even in a step that runs nothing, before the blocks are reused
            swap_blocks(self.kv_cache.layers, self.host_kv_cache.layers, so.blocks_to_swap_out)
        if so.blocks_to_swap_in:
            swap_blocks(self.host_kv_cache.layers, self.kv_cache.layers, so.blocks_to_swap_in)
        if so.blocks_to_copy:  # copy-on-write
            copies = torch.tensor(so.blocks_to_copy, dtype=torch.long, device=self.device)  # [P, 2]
            self.backend.copy_blocks(self.kv_cache.layers, copies)

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device: no copy on a CPU, one non-blocking copy on CUDA."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def close(self) -> None:
        """Nothing to stop in one process (the tensor-parallel runner stops its workers)."""
