"""The model runner: one SchedulerOutput in, ONE forward pass, the sampled tokens out.

Built in the engine core's order (roseinfer/engine/core.py), as vLLM's EngineCore builds it:

    runner = ModelRunner(config)                     the model (this rank's shard) and the persistent batch
    num_blocks = runner.determine_num_kv_blocks()    the pool asked for; on CUDA by default what the weights left
    config = config.with_num_gpu_blocks(num_blocks)  the final config, which the scheduler is built from
    runner.initialize_kv_cache(num_blocks)           the KV tensors, then what reads them (draft model, graphs)

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
                                                         brings k + 1 rows; a constrained request's forbidden
                                                         tokens -inf (structured outputs: the step's bitmask)
      6. sample (roseinfer/sample/)                      the whole batch at once; verifying requests go to
                                                         the rejection sampler; a request with candidates
                                                         returns its top tokens instead of a sample; the
                                                         log-probabilities asked for, from the raw logits
      7. write the sampled tokens into the batch, propose drafts for the next step (speculative decoding:
         `propose_draft_token_ids`; the runner keeps the draft model's probabilities until it verifies)

A request whose prompt log-probabilities are wanted also gets the LM head on every prompt position of each
of its chunks (roseinfer/sample/logprobs.py); they go back with its first sampled token.

A request the runner cannot set up (step 1) fails alone: it runs no part of this or any later step, and
`ModelRunnerOutput.errors` tells the scheduler, which frees it. A step that raises is run again in halves
until the requests that make it fail are found (roseinfer/worker/step_isolation.py, through `execute_part`); they
fail alone too.

The runner owns the model, the KV cache tensors (roseinfer/worker/kv_cache.py) and, on CUDA, the graphs of
decode steps (roseinfer/worker/cuda_graph.py). With tensor parallelism every rank runs the same steps on
its shard; only the driver (rank 0) computes logits and samples, and the others learn the sampled tokens
with the next step's message (`apply_sampled`).
"""

from __future__ import annotations

import numpy as np
import torch

from roseinfer.attention import GatherBuffer, get_backend
from roseinfer.config import EngineConfig
from roseinfer.core.request import as_token_ids
from roseinfer.core.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from roseinfer.model_executor.loader import load_model
from roseinfer.sample.grammar_bitmask import apply_grammar_bitmask
from roseinfer.sample.logprobs import to_lists
from roseinfer.sample.rejection_sampler import rejection_sample
from roseinfer.worker.input_batch import InputBatch
from roseinfer.worker.kv_cache import KVCache, num_blocks_that_fit, swap_blocks
from roseinfer.worker.prompt_logprobs import gather_prompt_logprobs
from roseinfer.worker.step_inputs import StepHandle, StepInputs, prepare_step, sample_plain
from roseinfer.worker.step_isolation import Failures, error_message, run_in_parts, spans, without


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, device: torch.device | None = None):
        """Load the model (this rank's shard of it) and set up the persistent batch. No KV cache yet: its size is
        the engine core's to decide (`determine_num_kv_blocks`), then `initialize_kv_cache` allocates it."""
        model_config, cache_config = config.model_config, config.cache_config
        self.config = config
        self.device = device or model_config.device
        self.tp_rank, self.tp_size = tp_rank, config.parallel_config.tensor_parallel_size
        self.is_driver = tp_rank == 0
        self.model = load_model(model_config.model_dir, model_config.hf_config, self.device, model_config.dtype,
                                tp_rank, self.tp_size, model_config.linear_backend,
                                model_config.custom_ops)  # fmt: skip
        self.backend = get_backend(model_config.attention_backend, self.device)
        self.block_size = cache_config.block_size
        lookahead = config.scheduler_config.num_lookahead_tokens
        max_blocks = -(-(model_config.max_model_len + lookahead) // self.block_size) + 1
        self.input_batch = InputBatch(model_config.max_model_len, max_blocks, self.block_size, model_config.vocab_size,
                                      self.device, capacity=max(64, config.scheduler_config.max_num_seqs),
                                      eos_token_ids=as_token_ids(model_config.eos_token_ids),
                                      samples=self.is_driver)  # fmt: skip
        self.failures = Failures(self.block_size)  # requests that failed alone, until the scheduler frees them
        self.gather_buffer = GatherBuffer()  # scratch reused by every step (see roseinfer/attention/sdpa.py)
        self._cached_rows = np.zeros(0, dtype=np.int64)  # rows of the step's cached requests, in their order
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> the draft model's q of its drafts [k, V]
        self.kv_cache: KVCache | None = None  # from initialize_kv_cache on
        self.host_kv_cache: KVCache | None = None
        self.proposer = None
        self.cuda_graphs = None

    # ---- the KV cache, sized once the weights are in -----------------------------------------
    def determine_num_kv_blocks(self) -> int:
        """The blocks of the KV pool: the number the config holds (num_blocks, or kv_cache_memory in blocks, or a
        CPU's default); on CUDA without one, what is left of the card's share once the weights are in."""
        model_config, cache_config = self.config.model_config, self.config.cache_config
        if cache_config.num_gpu_blocks is not None:
            return cache_config.num_gpu_blocks
        block_bytes = model_config.kv_bytes_per_token(self.tp_size) * self.block_size
        return num_blocks_that_fit(self.device, cache_config.gpu_memory_utilization, block_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool of `num_blocks` blocks (the engine core's final number; the same on every rank) and
        the host pool for swapping, then what reads the pool: the draft model (its own pool of as many blocks) and,
        on CUDA, the graphs of decode steps."""
        config, cache_config = self.config, self.config.cache_config
        hf, dtype = config.model_config.hf_config, config.model_config.kv_cache_dtype  # the pool's (fp8_kv.py)
        self.kv_cache = KVCache(hf, num_blocks, self.block_size, dtype, self.device, tp_size=self.tp_size)
        if cache_config.num_cpu_blocks:
            self.host_kv_cache = KVCache(hf, cache_config.num_cpu_blocks, self.block_size, dtype, self.device,
                                         host=True, tp_size=self.tp_size)  # fmt: skip
        if config.speculative_config is not None and self.is_driver:
            from roseinfer.spec_decode import make_proposer

            self.proposer = make_proposer(config, self)
        if (self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton"
                and self.tp_size == 1):  # fmt: skip
            from roseinfer.worker.cuda_graph import CUDAGraphRunner

            self.cuda_graphs = CUDAGraphRunner(self, max_batch_size=config.scheduler_config.max_num_seqs)
        if config.warmup:  # every oneDNN primitive built now: memory flat from the first request on
            from roseinfer.worker.warm_up import warm_up_linear_layers

            warm_up_linear_layers(self)

    # ---- one step ----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; return every sampled token (None on a rank that does not sample)."""
        return self.finish_step(self.launch_step(scheduler_output))

    @torch.inference_mode()
    def launch_step(self, scheduler_output: SchedulerOutput) -> StepHandle | ModelRunnerOutput | None:
        """Everything up to the sampled tokens. On CUDA the kernels are only queued: the tokens are on their way
        to pinned host memory when this returns, and `finish_step` waits for them (async scheduling schedules
        the next step in between). On a CPU the work is done by the time this returns."""
        scheduler_output, errors = self._update_states(scheduler_output)
        self.move_blocks(scheduler_output)
        try:
            result = EMPTY_MODEL_RUNNER_OUTPUT  # nothing to compute: a step of block moves, or of finished requests
            if scheduler_output.total_num_scheduled_tokens:
                result = self._launch(scheduler_output)
        except Exception as e:
            if self.tp_size > 1:
                raise  # every rank must run the same forwards: no retries on one of them
            result = run_in_parts(self, scheduler_output, e)
        if errors and self.is_driver:  # the requests that failed alone, for the scheduler to free
            if result is EMPTY_MODEL_RUNNER_OUTPUT:
                result = ModelRunnerOutput()
            (result.out if isinstance(result, StepHandle) else result).errors.update(errors)
        return result

    @torch.inference_mode()
    def execute_part(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run a part of a step whose batch updates are done (`without(step, others)`: step isolation runs a
        failed step again this way, in halves): its forward, its sampling, its tokens into the batch."""
        self._cached_rows = self.input_batch.rows(scheduler_output.scheduled_cached_reqs.req_ids)
        return self.finish_step(self._launch(scheduler_output))

    def _launch(self, scheduler_output: SchedulerOutput) -> StepHandle | ModelRunnerOutput | None:
        input_batch = self.input_batch
        ids = list(scheduler_output.num_scheduled_tokens)
        counts = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        only_cached = ids == scheduler_output.scheduled_cached_reqs.req_ids  # (most decode steps): rows known already
        rows = self._cached_rows if only_cached else input_batch.rows(ids)
        drafts = None
        if scheduler_output.scheduled_spec_decode_tokens:  # drafts go after the request's tokens, where they would be
            drafts = {}
            for rid, draft in scheduler_output.scheduled_spec_decode_tokens.items():
                row = input_batch.req_id_to_row[rid]
                n = int(input_batch.num_tokens[row])
                input_batch.token_ids[row, n : n + len(draft)] = draft
                drafts[rid] = len(draft)
        step = prepare_step(input_batch, ids, rows, input_batch.num_computed_tokens[rows], counts, self.backend,
                            self.gather_buffer, self.to_device)  # fmt: skip
        hidden = self._forward(step)
        if not self.is_driver:
            return None
        if input_batch.num_prompt_logprob_rows:
            gather_prompt_logprobs(input_batch, step, hidden, self.model.compute_logits, self.to_device)
        num_drafts = np.zeros(len(step.rows), dtype=np.int64)
        if drafts:
            num_drafts[:] = [drafts.get(r, 0) for r in step.req_ids]
        ends = step.seq_lens == input_batch.num_tokens[step.rows] + num_drafts  # reaches the end of its sequence
        pos = np.flatnonzero(ends)  # the requests that get tokens, in batch order
        forks = [fork for fork in scheduler_output.forks if fork.sample_now]
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
            last_logits_row = np.cumsum(nrows) - 1
            for fork in forks:
                logits_rows = np.append(logits_rows, logits_rows[last_logits_row[at[fork.parent_id]]])
                req_ids.append(fork.child_id)
                sample_rows = np.append(sample_rows, input_batch.req_id_to_row[fork.child_id])
            nrows = np.append(nrows, np.ones(len(forks), dtype=np.int64))
        logits = self.model.compute_logits(hidden[self.to_device(logits_rows)])  # [rows, V]
        if scheduler_output.grammar_bitmask is not None:  # structured outputs: what the grammars forbid is -inf
            apply_grammar_bitmask(logits, scheduler_output.structured_output_request_ids,
                                  scheduler_output.grammar_bitmask, req_ids, nrows)  # fmt: skip
        handle = self._sample(logits, req_ids, sample_rows, nrows, scheduler_output)
        if input_batch.prompt_logprobs_ready:  # prompts whose log-probabilities are all in go with the first token
            sampled = set(req_ids)
            for rid in [r for r in input_batch.prompt_logprobs_ready if r in sampled]:
                input_batch.prompt_logprobs_ready.discard(rid)
                state = input_batch.requests[rid]
                handle.out.prompt_logprobs[rid], state.prompt_logprobs = state.prompt_logprobs, None
        return handle

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
        if handle.logprobs is not None:  # one position per request that asked
            want, nums, (ids, lps, ranks) = handle.logprobs
            lists = to_lists(ids, lps, ranks, nums.tolist(), [1] * len(want))
            for i, lp in zip(want.tolist(), lists, strict=True):
                out.logprobs[out.req_ids[handle.plain[i]]] = lp
        if self.proposer is not None:
            out.spec_token_ids = self.propose_draft_token_ids(out)
        return out

    def propose_draft_token_ids(self, out: ModelRunnerOutput) -> dict[str, list[int]]:
        """The proposer's drafts for the next step of the requests of `out` (request id -> at most k tokens). The
        draft model's probabilities q of sampled drafts stay here, for the rejection sampler to verify them with."""
        proposal = self.proposer.propose(self, out)
        if not proposal.probs and not self._draft_probs:
            return proposal.token_ids  # guessed, not sampled (n-gram, greedy drafts): no q to keep or drop
        for rid in proposal.token_ids:
            q = proposal.probs.get(rid) if proposal.probs else None
            if q is None:
                self._draft_probs.pop(rid, None)
            else:
                self._draft_probs[rid] = q  # [k, V]
        return proposal.token_ids

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """hidden states [N, C] of every new token; on CUDA a decode step replays a captured graph."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(step):
            return self.cuda_graphs.run(step)
        return self.model.forward_paged(step.input_ids, step.positions, self.kv_cache.layers, step.attn_metadata)

    def _sample(self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, nrows: np.ndarray,
                scheduler_output: SchedulerOutput) -> StepHandle:  # fmt: skip
        """Turn the logits into tokens: the plain rows in one call of the sampler (their tokens come back through
        `finish_step`), verifying requests through the rejection sampler, the others into their candidates."""
        input_batch = self.input_batch
        chosen = input_batch.num_candidates[rows] > 0  # their next tokens are chosen outside, from candidates
        spec = nrows > 1
        plain = np.flatnonzero(~chosen & ~spec)
        all_plain = len(plain) == len(req_ids)
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=None if all_plain else [[] for _ in req_ids])
        handle = StepHandle(out, plain, rows if all_plain else rows[plain], None, None)
        last_row = np.cumsum(nrows) - 1  # each request's last logits row
        tokens = None
        if len(plain):  # all in one call of the sampler
            plain_logits = logits if all_plain else logits[self.to_device(last_row[plain])]
            tokens = sample_plain(input_batch, plain_logits, handle.rows, handle, self.to_device)
        verified = []
        if spec.any():
            verified = self._verify(logits, req_ids, rows, nrows, np.flatnonzero(spec), scheduler_output, out)
        for i in np.flatnonzero(chosen).tolist():  # the most likely next tokens, with their log-probabilities
            state = input_batch.requests[req_ids[i]]
            logprobs = torch.log_softmax(logits[int(last_row[i])].float(), dim=-1)  # [V]
            top = torch.topk(logprobs, min(state.num_candidates, logprobs.shape[0]))
            out.candidates[req_ids[i]] = (top.indices.tolist(), top.values.tolist())
        # the step's writes into the batch come last: a step that raised before them can run again
        if tokens is not None and input_batch.output_counts is not None:  # penalties: count what was sampled
            input_batch.count_sampled(self.to_device(handle.rows), tokens)
        for i, verified_tokens in verified:
            self._draft_probs.pop(req_ids[i], None)  # used: the next drafts bring their own
            input_batch.append_tokens(int(rows[i]), verified_tokens)
        return handle

    def _verify(self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, nrows: np.ndarray,
                idx: np.ndarray, scheduler_output: SchedulerOutput, out: ModelRunnerOutput) -> list:  # fmt: skip
        """Requests that verify drafts: their k + 1 rows each go to the rejection sampler, with the draft model's
        q of their drafts (kept since `propose_draft_token_ids`). Returns (index, tokens) of each, for `_sample` to
        write into the batch."""
        starts = np.cumsum(nrows) - nrows
        selected = np.concatenate([np.arange(starts[i], starts[i] + nrows[i]) for i in idx])
        ids = [req_ids[i] for i in idx]
        drafts = [scheduler_output.scheduled_spec_decode_tokens[r] for r in ids]
        qs = [self._draft_probs.get(r) for r in ids]
        probs = [None if q is None else q[: len(d)] for q, d in zip(qs, drafts, strict=True)]
        sampling = self.input_batch.sampling_tensors(rows[idx], logits.device)
        accepted = rejection_sample(logits[self.to_device(selected)], drafts, probs, sampling)
        verified = list(zip(idx.tolist(), accepted, strict=True))
        for i, tokens in verified:
            out.sampled_token_ids[i] = tokens
        return verified

    # ---- the persistent batch ----------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, str]]:
        """Apply the step's diffs: drop finished requests, add new ones and forks, update the rest. A request (or
        fork) that cannot be set up fails alone: the step goes on without it. Returns the step as it runs (without
        the failed requests) and the new failures, request id -> error message."""
        input_batch, failures = self.input_batch, self.failures
        for rid in scheduler_output.finished_req_ids:
            input_batch.remove_request(rid)
            failures.release(rid)
            self._draft_probs.pop(rid, None)
            if self.proposer is not None:
                self.proposer.free(rid)
        if failures.blocks:  # failed in an earlier step, not freed yet (async scheduling booked them again)
            scheduler_output = without(scheduler_output, failures.blocks)
        errors: dict[str, str] = {}
        for new in scheduler_output.scheduled_new_reqs:
            try:
                generator = self._generator(new.sampling_params, 0)
                input_batch.add_request(new.req_id, new.prompt_token_ids, new.sampling_params, new.block_ids,
                                        new.num_computed_tokens, generator, new.num_candidates)  # fmt: skip
            except Exception as e:
                errors[new.req_id] = error_message(new.req_id, e)
        for fork in scheduler_output.forks:
            if fork.parent_id in errors:
                errors[fork.child_id] = errors[fork.parent_id]
                continue
            try:
                params = input_batch.requests[fork.parent_id].params
                input_batch.fork(fork.parent_id, fork.child_id, fork.block_ids, self._generator(params, fork.index))
            except Exception as e:
                errors[fork.child_id] = error_message(fork.child_id, e)
        if errors:
            failures.add(errors, spans(scheduler_output, input_batch))
            scheduler_output = without(scheduler_output, failures.blocks)
        cached_reqs = scheduler_output.scheduled_cached_reqs
        self._cached_rows = rows = input_batch.rows(cached_reqs.req_ids)
        if cached_reqs.req_ids:
            self._update_cached(cached_reqs, rows)
        while failures.blocks and (readers := failures.readers(spans(scheduler_output, input_batch))):  # unwritten K/V
            for rid, culprit in readers.items():
                errors[rid] = f"request {rid!r} failed: it reads K/V blocks that request {culprit!r} failed to write"
            failures.add(readers, spans(scheduler_output, input_batch))
            scheduler_output = without(scheduler_output, failures.blocks)
            self._cached_rows = input_batch.rows(scheduler_output.scheduled_cached_reqs.req_ids)
        return scheduler_output, errors

    def _update_cached(self, cached_reqs, rows: np.ndarray) -> None:
        """The requests the runner holds: num_computed_tokens, block-table tails, tokens chosen elsewhere."""
        input_batch = self.input_batch
        input_batch.num_computed_tokens[rows] = cached_reqs.num_computed_tokens
        for i, update in enumerate(cached_reqs.new_block_ids):
            if update is not None:
                row = int(rows[i])
                input_batch.block_table.replace_from(row, *update)
                if self.proposer is not None:  # a draft's K/V past the change are gone
                    self.proposer.invalidate(cached_reqs.req_ids[i], update[0] * self.block_size)
        for i, tokens in enumerate(cached_reqs.new_token_ids):
            if tokens:  # chosen outside from its candidates, not by our sampler
                input_batch.append_tokens(int(rows[i]), tokens)

    def apply_sampled(self, out: ModelRunnerOutput | None) -> None:
        """A rank that does not sample learns the driver's tokens of the previous step (tensor parallelism)."""
        if out is None:
            return
        input_batch = self.input_batch
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if tokens and rid in input_batch.req_id_to_row:
                input_batch.append_tokens(input_batch.req_id_to_row[rid], tokens)

    def _generator(self, params, index: int) -> torch.Generator | None:
        return None if params.seed is None else params.make_generator(self.device, index)

    def move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The block copies a step asks for, in every layer, before anything writes (see SchedulerOutput)."""
        if scheduler_output.blocks_to_swap_out:  # even in a step that runs nothing, before the blocks are reused
            swap_blocks(self.kv_cache.layers, self.host_kv_cache.layers, scheduler_output.blocks_to_swap_out)
        if scheduler_output.blocks_to_swap_in:
            swap_blocks(self.host_kv_cache.layers, self.kv_cache.layers, scheduler_output.blocks_to_swap_in)
        if scheduler_output.blocks_to_copy:  # copy-on-write
            copies = torch.tensor(scheduler_output.blocks_to_copy, dtype=torch.long, device=self.device)  # [P, 2]
            self.backend.copy_blocks(self.kv_cache.layers, copies)

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device: no copy on a CPU, one non-blocking copy on CUDA."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def close(self) -> None:
        """Nothing to stop in one process (the tensor-parallel runner stops its workers)."""
