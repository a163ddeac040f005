"""The engine core: the scheduler and the model runner, one step at a time (vLLM V1's EngineCore).

    step():
        scheduler_output = scheduler.schedule()                          what runs now (data only)
        runner_output    = model_runner.execute_model(scheduler_output)  ONE forward, then sampling
        core_outputs     = scheduler.update_from_output(...)             append tokens, stops, free
                         + beam_search.on_step(...)                      beams whose search stepped

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
from roseinfer.engine.beam_search import BeamSearchCoordinator


class EngineCore:
    def __init__(self, config: EngineConfig):
        """Build the engine in vLLM's order: the model, then the KV cache it leaves room for, then the scheduler
        from the final config (which holds the pool's blocks)."""
        if config.parallel_config.tensor_parallel_size > 1:
            from roseinfer.worker.tp_worker import TensorParallelRunner

            self.model_runner = TensorParallelRunner(config)  # the model: every rank loads its shard
        else:
            from roseinfer.worker.model_runner import ModelRunner

            self.model_runner = ModelRunner(config)  # the model
        num_blocks = self.model_runner.determine_num_kv_blocks()  # the pool asked for, or what the weights left
        self.config = config = config.with_num_gpu_blocks(num_blocks)  # final: nothing changes it from here on
        self.model_runner.initialize_kv_cache(num_blocks)
        cc = config.cache_config
        self.kv_cache_manager = KVCacheManager(cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching,
                                               cc.num_cpu_blocks, cc.watermark)  # fmt: skip
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.beam_search = BeamSearchCoordinator(self.scheduler)
        self._in_flight = None  # async scheduling: (scheduler output, runner handle) of the step still running

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.is_beam:
            self.beam_search.add(request)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End every sequence of the caller's request now and give its blocks back."""
        group = self.scheduler.groups.get(request_id)
        if group is not None and request_id in self.beam_search.searches:
            self.beam_search.forget(group)
        self.scheduler.finish_requests(self.scheduler.sequence_ids(request_id), reason)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One step; with async scheduling, the outputs are those of the step before, which ran meanwhile."""
        if self.config.scheduler_config.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        out = self.model_runner.execute_model(so)
        return so, self._update(so, out)

    def _update(self, so: SchedulerOutput, out) -> list[EngineCoreOutput]:
        failed = self._fail(out.errors) if out.errors else []
        return failed + self.scheduler.update_from_output(so, out) + self.beam_search.on_step(out.beam_logprobs)

    def _fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Requests that failed in the runner (it could not set them up, or the step raised for them) fail alone:
        every sequence of the caller's request is freed now and reported with finish_reason "error" and why; the
        blocks only they held leave the prefix cache; the rest of the batch goes on."""
        outputs, sched = [], self.scheduler
        for rid, why in errors.items():
            req = sched.requests.get(rid)
            if req is None:
                continue  # already failed with a sibling
            group = req.group
            caller = group.group_id if group is not None else rid
            seqs = [sched.requests[s] for s in sched.sequence_ids(caller)]
            if caller in self.beam_search.searches:
                self.beam_search.forget(group)
            blocks = {b for s in seqs for b in self.kv_cache_manager.block_tables.get(s.request_id, ())}
            sched.finish_requests([s.request_id for s in seqs], "error")
            self.kv_cache_manager.forget_unheld_prefixes(blocks)  # they may hold K/V never written
            outputs += [EngineCoreOutput(s.request_id, [], "error", None if group is None else caller, s.index,
                                         num_cached_tokens=s.num_cached_tokens, error=why) for s in seqs]  # fmt: skip
        return outputs

    def _step_async(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Overlap the host with the GPU (vLLM's async scheduling):

            host   schedule t+1 │ wait t │ update t │ launch t+1 │ (engine: detokenize t) │ schedule t+2 ...
            GPU    ───── step t ───────┘            └──────────────── step t+1 ───────────────────────...

        Step t+1 is scheduled before step t's tokens are known: a request whose token is in flight counts it as a
        placeholder (one more token, not yet computed). Stops are found one step late: the request already
        scheduled for t+1 computes one token that is dropped."""
        so = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            prev, handle = self._in_flight
            outputs = self._update(prev, self.model_runner.finish_step(handle))
        self._in_flight = (so, self.model_runner.launch_step(so))
        return so, outputs

    def close(self) -> None:
        self.model_runner.close()
