"""LLMEngine: the online API (vLLM's names). Requests come and go while it runs.

    engine = LLMEngine(max_num_seqs=8)
    engine.add_request("a", "Romeo.\\n", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one scheduler step: one forward over every scheduled token
            print(out.request_id, repr(out.delta), out.finished)
        if time_for_more: engine.add_request("b", "Juliet.\\n")   # joins the running batch next step

A request's path, each hop converting data once:

    prompt ─► InputProcessor ─► Request (token ids) ─► EngineCoreClient ─► EngineCore: schedule
           ─► SchedulerOutput (data) ─► ModelRunner: one forward, sample ─► ModelRunnerOutput (ids)
           ─► EngineCore: append, stop, free ─► OutputProcessor: text, stop strings ─► RequestOutput

The engine holds the core only through its client (roseinfer/engine/core_client.py): it sends requests and
aborts, asks for a step, and reads counters, all as data; it never touches the scheduler, the KV cache
manager or the model runner behind it.

Each `step()` returns one RequestOutput per request that got a token (by its `output_kind`: everything so
far and the new text in `delta`, by default). A request whose prompt is still being prefilled in chunks
gets none yet. A request that failed in the engine on its own gets a last output with finish_reason "error"
and the reason in `error`; the others go on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence

from roseinfer.config import EngineArgs, EngineConfig
from roseinfer.core.request import Request
from roseinfer.core.sched.output import SchedulerOutput
from roseinfer.engine.core_client import EngineCoreClient
from roseinfer.engine.input_processor import InputProcessor
from roseinfer.engine.output_processor import OutputProcessor
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import BeamSearchParams, SamplingParams
from roseinfer.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, model=None, **kwargs):
        """`model`: a directory or Hub id (None: the bundled model); the other keyword arguments are
        `EngineArgs`' (roseinfer/config.py), e.g. max_num_seqs=8, enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4}, tensor_parallel_size=2."""
        self._setup(EngineArgs(model=model, **kwargs).create_engine_config())

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        engine = cls.__new__(cls)
        engine._setup(config)
        return engine

    def _setup(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.tokenizer = Tokenizer.from_model_dir(mc.model_dir, mc.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, mc.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, mc.eos_token_ids)
        self.engine_core = EngineCoreClient.make_client(config)
        self.config = self.engine_core.get_config()  # final: with the KV pool's size the core determined
        self.trace: list[dict] | None = None  # set to [] to record every step (notebooks, examples)
        self.last_scheduler_output: SchedulerOutput | None = None  # the latest step's message (data only)
        self.num_steps = 0
        freeze_startup_heap()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | BeamSearchParams | None = None
    ) -> None:
        """Queue a request. Bad input (and a prompt that can never fit the KV pool) raises here.
        `SamplingParams(n=...)` asks for n completions; `BeamSearchParams` runs a beam search."""
        if request_id in self.output_processor.requests or self.engine_core.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        if params is not None and not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        params = params or SamplingParams()
        text, prompt_ids = self.input_processor.process(prompt)
        self.input_processor.check_params(params)
        mc = self.config.model_config
        self.engine_core.add_request(Request(request_id, prompt_ids, params, mc.eos_token_ids, mc.max_model_len))
        self.output_processor.add_request(request_id, text, prompt_ids, params)

    def check_request(self, prompt: str | list[int], params: SamplingParams | BeamSearchParams) -> list[int]:
        """The checks `add_request` makes, without queueing anything: the prompt's token ids, or the error
        (a server answers it before it accepts the request)."""
        _, prompt_ids = self.input_processor.process(prompt)
        self.input_processor.check_params(params)
        mc = self.config.model_config
        self.engine_core.check_fits(Request("check", prompt_ids, params, mc.eos_token_ids, mc.max_model_len))
        return prompt_ids

    def abort_request(self, request_id: str) -> None:
        """Stop a waiting or running request now and give its KV blocks back."""
        if request_id not in self.output_processor.requests:
            raise KeyError(f"cannot abort unknown request id {request_id!r} (finished requests are forgotten)")
        self.engine_core.abort_requests([request_id])
        self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def close(self) -> None:
        """Stop the tensor-parallel workers; a no-op with one process."""
        self.engine_core.shutdown()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, one forward, update. Returns an output for every request that got a token."""
        try:
            scheduler_output, core_outputs = self.engine_core.step()
            outputs, stopped = self.output_processor.process_outputs(core_outputs)
            if stopped:  # stop strings: the core frees those sequences now, before the next step
                self.engine_core.finish_requests(stopped, "stop")
        except BaseException:  # (a request that fails in the model runner fails alone: finish_reason "error")
            for rid in list(self.output_processor.requests):  # any other failed step: fail every request, no leak
                self.abort_request(rid)
            self.reset_prefix_cache()  # blocks registered for this step may never have been written
            raise
        self.num_steps += 1
        self.last_scheduler_output = scheduler_output
        if self.trace is not None:
            done = [o.request_id for o in core_outputs if o.finish_reason is not None]
            self.trace.append(self._trace_entry(scheduler_output, done + stopped))
        return outputs

    def stream(
        self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Add one or many prompts (ids "0", "1", ...) and yield every output as steps produce them."""
        params = params if isinstance(params, Sequence) else [params] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self.add_request(str(i), prompt, p)
        while self.has_unfinished_requests():
            yield from self.step()

    # ---- counters ----------------------------------------------------------------------------
    def get_stats(self) -> dict:
        """The core's counters (`EngineCore.get_stats`: prefix cache, preemptions, KV blocks, swaps, queue
        lengths, and with speculative decoding the drafts proposed and accepted)."""
        return self.engine_core.get_stats()

    def spec_decode_stats(self) -> dict:
        """The speculative-decoding counters of `get_stats` (`EngineCore.spec_decode_stats`)."""
        return {k: v for k, v in self.get_stats().items() if k.startswith("spec_decode_")}

    def get_scheduler_state(self) -> dict:
        """Who waits, runs and is swapped out, and a copy of the KV books (`EngineCore.get_scheduler_state`)."""
        return self.engine_core.get_scheduler_state()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their K/V again (blocks in use stay)."""
        self.engine_core.reset_prefix_cache()

    def _trace_entry(self, scheduler_output: SchedulerOutput, finished: list[str]) -> dict:
        c = scheduler_output.scheduled_cached_reqs
        return {
            "step": self.num_steps,
            "ran": list(scheduler_output.num_scheduled_tokens),
            "num_scheduled_tokens": dict(scheduler_output.num_scheduled_tokens),
            "scheduled_spec_decode_tokens": {
                k: list(v) for k, v in scheduler_output.scheduled_spec_decode_tokens.items()
            },
            "scheduled_new_reqs": [r.req_id for r in scheduler_output.scheduled_new_reqs],
            "scheduled_resumed_reqs": [
                r for r, resumed in zip(c.req_ids, c.resumed_from_preemption, strict=True) if resumed
            ],  # fmt: skip
            "preempted_req_ids": list(scheduler_output.preempted_req_ids),
            "finished": finished,
            "blocks_to_swap_out": list(scheduler_output.blocks_to_swap_out),
            "blocks_to_swap_in": list(scheduler_output.blocks_to_swap_in),
            **self.engine_core.get_scheduler_state(),  # waiting, running, swapped, preemptions, the KV books
        }


_frozen = False


def freeze_startup_heap() -> None:
    """Move every object that exists once the first engine is built (the modules of torch, numpy, ...: hundreds
    of thousands) out of the garbage collector's sight, as vLLM's engine core does. The objects a step creates
    and keeps for a while (outputs, token lists) are promoted to the oldest generation, and each collection of
    that generation walks all of it: without this, those walks cost about 2 ms per step on average at 256
    running requests (chapter 16). Once per process: later objects stay collectable as usual."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
