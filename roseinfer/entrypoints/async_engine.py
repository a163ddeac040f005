"""AsyncLLMEngine (vLLM's name): `LLMEngine` for an asyncio server, one stream of outputs per request.

    engine = AsyncLLMEngine(LLMEngine(...))
    async for out in engine.generate("Romeo.\\n", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)             # each engine step that gives r1 a token yields once

Many requests share ONE engine and its batch. A background task (the step loop) owns the engine:

    event loop (HTTP handlers)                   tokenizer threads           step thread (only one)
    generate(prompt) ──► check_request ────────► encode, check ──┐
                     ◄── token ids ◄─────────────────────────────┘
                    pending.append(ids) ──wake──► step loop ──────────────► _step_in_thread(new, aborts):
                    await queue.get()                                         abort, add_request, engine.step()
                    ◄── queue.put(output) ◄──────────────────────────────── outputs, per request id ◄──┘

- The forward pass runs in the step thread, so the event loop keeps accepting connections and writing
  streams while the model computes (PyTorch releases the GIL in its kernels). It is one dedicated thread:
  tokenizing a huge prompt in the other pool can never delay a step.
- Prompts are tokenized in other threads, never on the event loop nor in the step thread: a 10 MB prompt
  takes seconds to tokenize, and the streams of everyone else go on meanwhile. `LLMEngine.check_request` is
  safe there while a step runs: it reads the tokenizer and the pool's fixed sizes, nothing a step changes.
  (The tokenizers library releases the GIL in `encode_batch`, tiktoken in `encode`.)
- The engine is not thread-safe, so only the step thread touches it: new requests and aborts are handed
  over in lists and applied at the start of the next step, never in the middle of one.
- A request whose consumer goes away (the HTTP client disconnected, the generator was closed) is aborted
  before the next step: its KV blocks come back within one step. A request the engine refuses, or whose
  step fails, gets the error in its own stream; the others go on (a failed step fails every request in it).
- Timings for the metrics (stats.py) are taken here: the step thread notes when a request was first
  scheduled, the loop when its tokens came out. After every turn `stat_logger(snapshot, iteration)` runs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.entrypoints.stats import IterationStats, RequestStateStats
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams


@dataclass
class EngineSnapshot:
    """The engine's state after a step, read in the step thread (for /metrics and the waiting limit)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class StepResult:
    """What `_step_in_thread` hands back to the loop."""

    outputs: list[tuple[str, RequestOutput]]
    errors: list[tuple[str, BaseException, bool]]  # (request id, error, whether it had been running)
    scheduled: list[tuple[str, float]]  # requests scheduled for the first time, and when
    snapshot: EngineSnapshot


@dataclass(slots=True)
class _RequestState:
    queue: asyncio.Queue
    stats: RequestStateStats


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.snapshot = EngineSnapshot(stats=engine.get_stats())
        self._requests: dict[str, _RequestState] = {}  # request id -> its outputs (or an exception), its stats
        self._pending: list[tuple[str, list[int], SamplingParams]] = []  # to add before the next step
        self._handing = 0  # requests taken from _pending by the step in progress (not yet in a snapshot)
        self._preparing = 0  # requests being tokenized (check_request)
        self._aborts: set[str] = set()  # to abort before the next step
        self._unscheduled: dict[str, None] = {}  # step thread: ids added, not yet scheduled, oldest first
        self._iteration = IterationStats()  # what happened since the last turn (aborts noticed meanwhile)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_pool: ThreadPoolExecutor | None = None
        self._stopping = False
        self._closed_error: BaseException | None = None  # set by abort_all
        self._ids = itertools.count()
        self.stat_logger: Callable[[EngineSnapshot, IterationStats], None] | None = None  # after every turn

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not finished: queued for the engine, waiting, running or swapped."""
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that do not run yet (being tokenized, not yet handed to the engine, or in its
        waiting queue)."""
        return self._preparing + len(self._pending) + self._handing + self.snapshot.num_waiting

    def start(self) -> None:
        """Start the step loop (call inside the running event loop)."""
        if self._loop_task is None:
            self._stopping, self._closed_error = False, None
            self._wake = asyncio.Event()
            self._step_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roseinfer-step")
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def shutdown(self) -> None:
        if self._loop_task is not None:  # let a step in the step thread finish: it cannot be interrupted
            self._stopping = True
            self._wake.set()
            await self._loop_task
            self._loop_task = None
            self._step_pool.shutdown(wait=True)
        for rid in self.engine.unfinished_request_ids:  # nothing may keep a block after the server is gone
            self.engine.abort_request(rid)
        self._unscheduled.clear()

    async def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """`LLMEngine.check_request` (tokenize, check, check that it can ever fit) in a tokenizer thread: the
        prompt's token ids, or the ValueError / TypeError. It counts as waiting meanwhile."""
        self._preparing += 1
        try:
            return await asyncio.to_thread(self.engine.check_request, prompt, params)
        finally:
            self._preparing -= 1

    def abort_all(self, error: BaseException) -> None:
        """End every unfinished request now, for a server shutting down: each stream raises `error`, and so does
        any request that comes later."""
        self._closed_error, now = error, time.perf_counter()
        for rid, state in self._requests.items():
            state.queue.put_nowait(error)
            self._aborts.add(rid)
            self._iteration.finish(state.stats, "abort", now)
        self._requests.clear()
        if self._wake is not None:
            self._wake.set()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Queue a request and yield its outputs as the steps produce them; the last one is finished.
        A text prompt is tokenized in a thread first; bad input (a prompt too long for the pool) raises
        here, before the first output. Closing the generator early aborts the request. `arrival_time`
        (time.perf_counter()) is when the caller took the request: the start of its latencies."""
        self.start()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = await self.check_request(prompt, params) if text is not None else prompt
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if self._closed_error is not None:
            raise self._closed_error
        state = _RequestState(asyncio.Queue(), RequestStateStats(arrival, params.output_kind))
        self._requests[rid] = state
        self._pending.append((rid, ids, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine never took it, the step failed, or abort_all: nothing to abort
                    raise item
                finished = item.finished
                if text is not None:
                    item.prompt = text
                yield item
        finally:
            if self._requests.pop(rid, None) is not None and not finished:  # the consumer left early
                self._aborts.add(rid)  # free its blocks before the next step
                self._iteration.finish(state.stats, "abort", time.perf_counter())
                self._wake.set()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping and (self._pending or self._aborts or self.engine.has_unfinished_requests()):
                new, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, set()
                self._handing = len(new)  # they wait until a snapshot shows where they went
                result = await loop.run_in_executor(self._step_pool, self._step_in_thread, new, aborts)
                self.snapshot, self._handing = result.snapshot, 0  # together, in the event loop: never counted twice
                self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        """Hand each output or error to its request's queue, and note the timings (event loop)."""
        now, it = time.perf_counter(), self._iteration
        for rid, ts in result.scheduled:
            if (state := self._requests.get(rid)) is not None:
                state.stats.scheduled_ts = ts
        for rid, out in result.outputs:
            state = self._requests.get(rid)
            if state is None:
                continue
            it.update_from_output(out, state.stats, now)
            if out.finished:
                it.finish(state.stats, out.finish_reason, now)
            state.queue.put_nowait(out)
        for rid, error, was_running in result.errors:
            if (state := self._requests.get(rid)) is not None:
                if was_running:
                    it.finish(state.stats, "abort", now)
                self._requests.pop(rid)  # no abort to send: the engine has none of it left
                state.queue.put_nowait(error)
        self._iteration = IterationStats()
        if self.stat_logger is not None:
            self.stat_logger(result.snapshot, it)

    def _step_in_thread(self, new, aborts) -> StepResult:
        """Everything that touches the engine: aborts, admissions, one step, a snapshot."""
        eng, outputs, errors, scheduled = self.engine, [], [], []
        unfinished = eng.output_processor.requests
        for rid in aborts:
            self._unscheduled.pop(rid, None)
            if rid in unfinished:
                eng.abort_request(rid)
        for rid, prompt, params in new:
            if rid in aborts:
                continue  # gone before it was ever added
            try:
                eng.add_request(rid, prompt, params)
            except Exception as e:  # this request only: the engine checks before it queues anything
                errors.append((rid, e, False))
                continue
            self._unscheduled[rid] = None
        if eng.has_unfinished_requests():
            live, start = eng.unfinished_request_ids, time.perf_counter()
            try:
                for o in eng.step():
                    if o.error is None:
                        outputs.append((o.request_id, o))
                    else:  # it failed alone inside the engine, its blocks freed: an error for its caller only
                        errors.append((o.request_id, RuntimeError(o.error), True))
                scheduled = self._take_scheduled(start)
            except Exception as e:  # the engine has aborted every request and freed their blocks
                self._unscheduled.clear()
                errors += [(rid, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"), True) for rid in live]
        stats = eng.get_stats()
        num = stats["num_running_reqs"], stats["num_waiting_reqs"], stats["num_swapped_reqs"]
        snapshot = EngineSnapshot(*num, stats)
        return StepResult(outputs, errors, scheduled, snapshot)

    def _take_scheduled(self, start: float) -> list[tuple[str, float]]:
        """The requests this step scheduled for the first time, with the step's start: those in the step's
        `SchedulerOutput`. Waiting requests are admitted oldest first, so the scan stops at the first one that
        is neither scheduled nor gone (finished or aborted before it ever ran: dropped without a time)."""
        ran = self.engine.last_scheduler_output.num_scheduled_tokens
        unfinished, seen = self.engine.output_processor.requests, []
        for rid in self._unscheduled:
            if rid not in ran and rid in unfinished:
                break
            seen.append(rid)
        for rid in seen:
            del self._unscheduled[rid]
        return [(rid, start) for rid in seen if rid in ran]
