"""LLMEngine: the online API (vLLM's names). Requests come and go while it runs.

    engine = LLMEngine(max_num_seqs=8)
    engine.add_request("a", "Romeo.\\n", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one scheduler step: one forward over every scheduled token
            print(out.request_id, repr(out.delta), out.finished)
        if time_for_more: engine.add_request("b", "Juliet.\\n")   # joins the running batch next step

Each `step()` is three calls (stage 09, vLLM v1's loop):

    scheduler_output = scheduler.schedule()                   # who computes how many tokens
    sampled = model_runner.execute_model(scheduler_output)     # ONE forward pass, then sampling
    scheduler.update_from_output(scheduler_output, sampled)    # advance requests, append tokens

and returns one RequestOutput per request that got a new token, with the text that became final
in this step (`delta`). A request whose prompt is still being prefilled in chunks gets none yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from roseinfer.beam_search import BeamSearchState
from roseinfer.checks import check_bool, check_int, check_swap_args
from roseinfer.engine import InferenceEngine
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.sampling import BeamSearchParams, SamplingParams
from roseinfer.scheduler import Scheduler
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.sequence_group import SequenceGroup
from roseinfer.session import InferenceSession
from roseinfer.spec_decode import SpeculativeConfig, can_speculate, make_proposer


class LLMEngine:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        preemption_mode: str | None = None,
        swap_space: float = 4,
        speculative_config: dict | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
    ):
        """`max_num_batched_tokens`: tokens one step may compute (default 2048, or the model's context
        if larger and chunked prefill is off); `enable_chunked_prefill`: cut long prompts into chunks
        that fit the budget, so running requests keep decoding while a long prompt is prefilled;
        `enable_prefix_caching`: requests whose prompts start alike share the K/V blocks of that start.
        Stage 12 (vLLM's names and defaults): `watermark`, the fraction of KV blocks that admitting a new
        request must leave free; `preemption_mode` None (recompute a request with one sequence, swap one
        with several), "recompute" or "swap"; `swap_space`, GiB of host memory for swapped-out blocks.
        Stage 14: `speculative_config` (vLLM's keys), e.g. {"method": "ngram", "num_speculative_tokens": 4}
        or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}: see roseinfer/spec_decode.
        Stage 15: `tensor_parallel_size` processes share the model, 1/N of every layer each; `close()` stops them."""
        check_int("max_num_seqs", max_num_seqs)  # before loading anything
        check_int("max_num_batched_tokens", max_num_batched_tokens, none_ok=True)
        check_bool("enable_chunked_prefill", enable_chunked_prefill)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_swap_args(watermark, preemption_mode, swap_space)
        spec = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
        self.engine = InferenceEngine(
            model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend, tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip
        self.tokenizer = self.engine.tokenizer
        self.block_manager = self.engine.make_block_manager(enable_prefix_caching, swap_space, watermark)
        self.model_runner = self.engine.make_runner(self.block_manager)  # allocates the KV pool now
        n_ctx = self.engine.config.n_positions
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, n_ctx)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                   max_model_len=n_ctx, preemption_mode=preemption_mode)  # fmt: skip
        self.speculative_config = spec
        self.proposer = make_proposer(spec, self.engine, self.block_manager.num_blocks) if spec else None
        self.sessions: dict[str, InferenceSession] = {}  # unfinished requests by id
        self.trace: list[dict] | None = None  # set to [] to record every step (notebooks, examples)
        self.num_steps = 0

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | BeamSearchParams | None = None
    ) -> None:
        """Queue a request. Bad input (and a prompt that can never fit the KV pool) raises here.
        `SamplingParams(n=...)` asks for n completions; `BeamSearchParams` runs a beam search (stage 11)."""
        if request_id in self.sessions:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if params is not None and not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        session = self.engine.new_session(request_id, prompt, params or SamplingParams())
        if isinstance(params, BeamSearchParams):
            end = min(session.num_tokens + params.max_tokens, session.max_context)
            eos = None if params.ignore_eos else self.engine.eos_token_id
            state = BeamSearchState(params.beam_width, params.length_penalty, eos, session.num_tokens, end)
            session.group = SequenceGroup(request_id, [session], beam=state)
        self.scheduler.add(session)
        self.sessions[request_id] = session

    def abort_request(self, request_id: str) -> None:
        """Stop a waiting or running request now and give its KV blocks back."""
        if request_id not in self.sessions:
            raise KeyError(f"cannot abort unknown request id {request_id!r} (finished requests are forgotten)")
        self._retire(self.sessions[request_id], reason="abort")

    def close(self) -> None:
        """Stop the tensor-parallel workers (stage 15); a no-op with one process."""
        self.engine.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.sessions)

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, one forward, update. Returns an output for every request that got a token."""
        try:
            if self.proposer is not None:  # stage 14: guesses for every decoding request, verified in this step
                self.proposer.propose([s for s in self.scheduler.running if can_speculate(s)])
            sched = self.scheduler.schedule()
            sampled = self.model_runner.execute_model(sched)
            produced = self.scheduler.update_from_output(sched, sampled)
        except BaseException:
            for s in list(self.sessions.values()):  # a failed forward: fail every request, leak no block
                self._retire(s, reason="abort")
            self.reset_prefix_cache()  # blocks registered for this step may never have been written
            raise
        outputs, groups = [], {}
        for s in produced:
            if s.group is None:
                outputs.append(s.output(delta=s.last_delta))
                if s.finished:
                    self._retire(s)
                continue
            if s.finished and s.group.beam is None:  # one of n completions ended: its blocks go back
                self.scheduler.finish(s)
            groups[id(s.group)] = s.group
        for group in groups.values():  # stage 11: one output per request, with all its completions
            outputs.append(self._group_output(group))
            if group.finished:
                self._retire(self.sessions[group.request_id])
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append(self._trace_entry(sched))
        return outputs

    def get_stats(self) -> dict:
        """Counters since the engine started (vLLM's names): prefix-cache lookups and hits in tokens,
        preemptions, and KV blocks in use (held by a request) out of the pool; stage 12: swaps and host blocks;
        stage 14: drafts proposed and accepted (see `spec_decode_stats`)."""
        sched, bm = self.scheduler, self.block_manager
        return {
            **(self.spec_decode_stats() if self.proposer is not None else {}),
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "kv_blocks_used": bm.num_used_blocks,  # read after every step by the server: O(1)
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_cached": len(bm.pool.cached),  # full blocks findable by their prefix, in use or free
            "num_swapped_out": sched.num_swapped_out,  # stage 12: requests swapped out / in
            "num_swapped_in": sched.num_swapped_in,
            "swap_blocks_used": bm.num_swap_blocks_used,  # host blocks held by swapped requests
            "swap_blocks_total": bm.num_cpu_blocks,
        }

    def spec_decode_stats(self) -> dict:
        """Stage 14: verifications ("drafts"), draft tokens checked and accepted, the acceptance rate, the mean
        acceptance length (tokens a verifying step yields: accepted drafts + the target's own token) and the
        acceptance rate at each draft position (position i is only reached if drafts 0 .. i-1 passed)."""
        s = self.scheduler
        drafts, proposed, accepted = (
            s.spec_decode_num_drafts,
            s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens,
        )
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_num_accepted_tokens_per_pos": list(s.spec_decode_num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate_per_pos": [n / drafts for n in s.spec_decode_num_accepted_tokens_per_pos]
            if drafts
            else [],
        }

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their K/V again (blocks in use stay)."""
        self.block_manager.pool.reset()

    def stream(
        self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Add one or many prompts (ids "0", "1", ...) and yield every output as steps produce them."""
        params = params if isinstance(params, Sequence) else [params] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self.add_request(str(i), prompt, p)
        while self.has_unfinished_requests():
            yield from self.step()

    def _retire(self, session: InferenceSession, reason: str | None = None) -> None:
        for s in session.group.seqs if session.group is not None else [session]:
            if reason and not s.finished:
                s.finish_reason = reason
            self.scheduler.finish(s)
            if self.proposer is not None:  # stage 14: the draft model's blocks for it go back too
                self.proposer.free(s.request_id)
        self.sessions.pop(session.request_id, None)

    def _group_output(self, group: SequenceGroup) -> RequestOutput:
        """The request's output (stage 11): all its completions, the first one also as text / token_ids."""
        parent = self.sessions[group.request_id]
        completions = group.completions(self.tokenizer)
        first = completions[0] if completions else CompletionOutput(0, "", [], None)
        return RequestOutput(
            request_id=group.request_id, prompt=parent.prompt, prompt_token_ids=list(parent.prompt_ids),
            text=first.text, token_ids=list(first.token_ids),
            finish_reason=first.finish_reason if group.finished else None,
            delta=parent.last_delta if group.beam is None else "", num_cached_tokens=parent.num_cached_tokens,
            outputs=completions,
        )  # fmt: skip

    def _trace_entry(self, sched: SchedulerOutput) -> dict:
        return {
            "step": self.num_steps,
            "ran": [s.request_id for s in sched.scheduled],
            "num_scheduled_tokens": dict(sched.num_scheduled_tokens),
            "scheduled_spec_decode_tokens": {k: list(v) for k, v in sched.scheduled_spec_decode_tokens.items()},
            "scheduled_new_reqs": sched.scheduled_new_reqs,
            "scheduled_resumed_reqs": sched.scheduled_resumed_reqs,
            "preempted_req_ids": sched.preempted_req_ids,
            "finished": [s.request_id for s in sched.scheduled if s.finished],
            "waiting": [s.request_id for s in self.scheduler.waiting],
            "swapped": [s.request_id for s in self.scheduler.swapped],
            "blocks_to_swap_out": list(sched.blocks_to_swap_out),
            "blocks_to_swap_in": list(sched.blocks_to_swap_in),
            "running": [s.request_id for s in self.scheduler.running],
            "preemptions": self.scheduler.num_preemptions,
            **self.block_manager.snapshot(),
        }
