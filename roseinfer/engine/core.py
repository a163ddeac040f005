"""The engine core: the scheduler and the model runner, one step at a time (vLLM V1's EngineCore).

    step():
        scheduler_output = scheduler.schedule()                          what runs now (data only)
        structured_output_manager.grammar_bitmask(..., scheduler_output) constrained rows' allowed tokens
        runner_output    = model_runner.execute_model(scheduler_output)  ONE forward, then sampling
        core_outputs     = scheduler.update_from_output(...)             append tokens, stops, free
        structured_output_manager.accept_outputs(...)                    the tokens move their grammars on
        (groups whose next tokens are chosen here: beam_search.step(o) -> scheduler.update_group(update))

A request that fails in the runner fails alone (`ModelRunnerOutput.errors`, see roseinfer/worker/step_isolation.py):
the core frees every sequence of it and reports finish_reason "error"; the rest of the batch goes on.

Everything here is token ids: the engine in front of it (roseinfer/engine/llm_engine.py) tokenizes prompts
and detokenizes what comes out. In vLLM the core runs in a process of its own so that this loop never waits
for Python work on text; here it is a plain object in the same process, with the same boundary.
"""

from __future__ import annotations

from roseinfer.config import EngineConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.request import Request
from roseinfer.core.sched.output import EngineCoreOutput, SchedulerOutput
from roseinfer.core.sched.scheduler import Scheduler
from roseinfer.engine.beam_search import BeamSearch
from roseinfer.structured_output import StructuredOutputManager
from roseinfer.worker import make_model_runner


class EngineCore:
    def __init__(self, config: EngineConfig):
        """Build the engine in vLLM's order: the model, then the KV cache it leaves room for, then the scheduler
        from the final config (which holds the pool's blocks)."""
        self.model_runner = make_model_runner(config)  # the model (with tensor parallelism, on every rank)
        num_blocks = self.model_runner.determine_num_kv_blocks()  # the pool asked for, or what the weights left
        self.config = config = config.with_num_gpu_blocks(num_blocks)  # final: nothing changes it from here on
        self.model_runner.initialize_kv_cache(num_blocks)
        cc = config.cache_config
        self.kv_cache_manager = KVCacheManager(cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching,
                                               cc.num_cpu_blocks, cc.watermark)  # fmt: skip
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.beam_search = BeamSearch()  # chooses the next tokens of the groups that report candidates
        self.structured_output_manager = StructuredOutputManager(config)  # grammars: compiled, masks, matchers
        self._in_flight = None  # async scheduling: (scheduler output, runner handle) of the step still running

    def add_request(self, request: Request) -> None:
        self.beam_search.prepare(request)  # (a beam search runs as a group that returns candidates)
        self.scheduler.check_fits(request)
        self.structured_output_manager.grammar_init(request)  # compiling starts (in a thread) now
        self.scheduler.add_request(request)
        self.beam_search.add(request)

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never fit the KV pool (nothing is queued)."""
        self.beam_search.prepare(request)
        self.scheduler.check_fits(request)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def finish_requests(self, sequence_ids, reason: str) -> None:
        """End these sequences now (the output processor found a stop string in them) and free their blocks."""
        self.scheduler.finish_requests(sequence_ids, reason)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End every sequence of the caller's request now and give its blocks back."""
        self.beam_search.forget(request_id)
        self.scheduler.finish_requests(self.scheduler.sequence_ids(request_id), reason)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One step; with async scheduling, the outputs are those of the step before, which ran meanwhile."""
        so, sched = self.structured_output_manager, self.scheduler
        if so.compiling and not (sched.running or sched.swapped or any(r.is_ready for r in sched.waiting)):
            so.wait_for_grammars(timeout=0.05)  # nothing can run until a grammar is compiled: wait for it
        failed = self._fail(so.failed_requests()) if so.compiling else []  # a grammar that did not compile
        if self.config.scheduler_config.async_scheduling:
            scheduler_output, outputs = self._step_async()
            return scheduler_output, failed + outputs
        scheduler_output = self.scheduler.schedule()
        so.grammar_bitmask(self.scheduler.requests, scheduler_output)
        runner_output = self.model_runner.execute_model(scheduler_output)
        return scheduler_output, failed + self._update(scheduler_output, runner_output)

    def _update(self, scheduler_output: SchedulerOutput, runner_output) -> list[EngineCoreOutput]:
        failed = self._fail(runner_output.errors) if runner_output.errors else []
        outputs = failed + self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.candidates:  # groups whose next tokens are chosen here may have reported theirs
            outputs = self._choose(outputs)
        if self.structured_output_manager.constrained:  # the sampled tokens move the grammars on
            ended, refused = self.structured_output_manager.accept_outputs(self.scheduler.requests, outputs)
            if ended:  # a grammar that reached its end finishes its request, as a stop token would
                self.scheduler.finish_requests(ended, "stop")
            if refused:
                outputs = [o for o in outputs if o.request_id not in refused] + self._fail(refused)
        return outputs

    def _choose(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A group that reported its candidates takes its next step: the beam search picks it, the scheduler
        carries it out; a finished search's output takes the place of its candidates."""
        kept = []
        for o in outputs:
            if o.candidates is None:
                kept.append(o)
                continue
            update, final = self.beam_search.step(o)
            self.scheduler.update_group(update)
            if final is not None:
                kept.append(final)
        return kept

    def _fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Requests that failed in the runner (it could not set them up, or the step raised for them) fail alone:
        every sequence of the caller's request is freed now and reported with finish_reason "error" and why; the
        blocks only they held leave the prefix cache; the rest of the batch goes on."""
        outputs, sched = [], self.scheduler
        for rid, error_message in errors.items():
            req = sched.requests.get(rid)
            if req is None:
                continue  # already failed with a sibling
            group = req.group
            caller = group.group_id if group is not None else rid
            seqs = [sched.requests[s] for s in sched.sequence_ids(caller)]
            self.beam_search.forget(caller)
            blocks = {b for s in seqs for b in self.kv_cache_manager.block_tables.get(s.request_id, ())}
            sched.finish_requests([s.request_id for s in seqs], "error")
            self.kv_cache_manager.forget_unheld_prefixes(blocks)  # they may hold K/V never written
            parent = None if group is None else caller
            outputs += [
                EngineCoreOutput(s.request_id, [], "error", parent, s.index, num_cached_tokens=s.num_cached_tokens,
                                 error=error_message)
                for s in seqs
            ]  # fmt: skip
        return outputs

    def _step_async(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Overlap the host with the GPU (vLLM's async scheduling):

            host   schedule t+1 │ wait t │ update t │ launch t+1 │ (engine: detokenize t) │ schedule t+2 ...
            GPU    ───── step t ───────┘            └──────────────── step t+1 ───────────────────────...

        Step t+1 is scheduled before step t's tokens are known: a request whose token is in flight counts it as a
        placeholder (one more token, not yet computed). Stops are found one step late: the request already
        scheduled for t+1 computes one token that is dropped."""
        scheduler_output = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            prev, handle = self._in_flight
            outputs = self._update(prev, self.model_runner.finish_step(handle))
        self.structured_output_manager.grammar_bitmask(self.scheduler.requests, scheduler_output)  # after t's tokens
        self._in_flight = (scheduler_output, self.model_runner.launch_step(scheduler_output))
        return scheduler_output, outputs

    # ---- what the core tells about itself (data only) ------------------------------------
    def get_stats(self) -> dict:
        """Counters since the engine started (vLLM's names): prefix-cache lookups and hits in tokens,
        preemptions, KV blocks in use (held by a request) out of the pool, swaps and host blocks, the requests
        running (a request of n sequences counts once), waiting and swapped out, and with speculative decoding
        the drafts proposed and accepted (see `spec_decode_stats`)."""
        sched, kv = self.scheduler, self.kv_cache_manager
        running = {s.group.group_id if s.group else s.request_id for s in sched.running}
        return {
            **(self.spec_decode_stats() if self.config.speculative_config is not None else {}),
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "kv_blocks_used": kv.num_used_blocks,  # read after every step by the server: O(1)
            "kv_blocks_total": kv.num_blocks,
            "kv_cache_bytes": self.model_runner.kv_cache.nbytes,  # the pool's K/V tensors (this rank's share)
            "kv_blocks_cached": len(kv.pool.cached),  # full blocks findable by their prefix, in use or free
            "num_swapped_out": sched.num_swapped_out,  # requests swapped out / in
            "num_swapped_in": sched.num_swapped_in,
            "swap_blocks_used": kv.num_swap_blocks_used,  # host blocks held by swapped requests
            "swap_blocks_total": kv.num_cpu_blocks,
            "num_running_reqs": len(running),
            "num_waiting_reqs": len(sched.waiting),
            "num_swapped_reqs": len(sched.swapped),
        }

    def spec_decode_stats(self) -> dict:
        """Verifications ("drafts"), draft tokens checked and accepted, the acceptance rate, the mean acceptance
        length (tokens a verifying step yields: accepted drafts + the target's own token) and the acceptance
        rate at each draft position (position i is only reached if drafts 0 .. i-1 passed)."""
        s = self.scheduler.spec_decoding_stats
        drafts, proposed = s.num_drafts, s.num_draft_tokens
        accepted, per_pos = s.num_accepted_tokens, s.num_accepted_tokens_per_pos
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_num_accepted_tokens_per_pos": list(per_pos),
            "spec_decode_acceptance_rate_per_pos": [n / drafts for n in per_pos] if drafts else [],
        }

    def get_scheduler_state(self) -> dict:
        """Who waits, runs and is swapped out (sequence ids, in queue order), the preemptions so far, the live
        sequences of each group and their tokens, and a copy of the KV books (`KVCacheManager.snapshot`): for
        traces and pictures."""
        sched = self.scheduler
        return {
            "waiting": [r.request_id for r in sched.waiting],
            "swapped": [r.request_id for r in sched.swapped],
            "running": [r.request_id for r in sched.running],
            "preemptions": sched.num_preemptions,
            "groups": {  # n > 1 and beam search: each live sequence's generated token ids
                gid: {s.request_id: list(s.output_token_ids) for s in g.seqs if not s.finished}
                for gid, g in sched.groups.items()
            },
            **self.kv_cache_manager.snapshot(),
        }

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def apply_model(self, fn):
        """`fn(model)` on this process's model (rank 0 with tensor parallelism)."""
        return fn(self.model_runner.model)

    def close(self) -> None:
        self.structured_output_manager.close()
        self.model_runner.close()
