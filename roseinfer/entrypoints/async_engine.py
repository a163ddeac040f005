"""AsyncLLMEngine (vLLM's name): `LLMEngine` for an asyncio server, one stream of outputs per request.

    engine = AsyncLLMEngine(LLMEngine(...))
    async for out in engine.generate("Romeo.\\n", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)             # each engine step that gives r1 a token yields once

Many requests share ONE engine and its batch. A background task (the step loop) owns the engine:

    event loop (HTTP handlers)                         worker thread (one at a time)
    generate(): pending.append(request) ──wake──►  step loop ──► _step_in_thread(new, aborts):
                await queue.get()                                  abort, add_request, engine.step()
                ◄── queue.put(output) ◄──────────── outputs of the step, per request id ◄──┘

- The forward pass runs in a worker thread (`asyncio.to_thread`), so the event loop keeps accepting
  connections and writing streams while the model computes. PyTorch releases the GIL in its kernels.
- The engine is not thread-safe, so only the worker thread touches it: new requests and aborts are
  handed over in lists and applied at the start of the next step, never in the middle of one.
- A request whose consumer goes away (the HTTP client disconnected, the generator was closed) is
  aborted before the next step: its KV blocks come back within one step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams


@dataclass
class EngineSnapshot:
    """The engine's state after a step, read in the worker thread (for /metrics and the waiting limit)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    stats: dict[str, int] = field(default_factory=dict)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.snapshot = EngineSnapshot(stats=engine.get_stats())
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs (or an exception)
        self._pending: list[tuple[str, str | list[int], SamplingParams]] = []  # to add before the next step
        self._handing = 0  # requests taken from _pending by the step in progress (not yet in a snapshot)
        self._aborts: set[str] = set()  # to abort before the next step
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self._ids = itertools.count()
        self.on_step = None  # called (in the event loop) with the snapshot after every step (metrics)

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not finished: queued for the engine, waiting, running or swapped."""
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that do not run yet (not yet handed to the engine, or in its waiting queue)."""
        return len(self._pending) + self._handing + self.snapshot.num_waiting

    def start(self) -> None:
        """Start the step loop (call inside the running event loop)."""
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def shutdown(self) -> None:
        if self._loop_task is not None:  # let a step in the worker thread finish: it cannot be interrupted
            self._stopping = True
            self._wake.set()
            await self._loop_task
            self._loop_task = None
        for rid in self.engine.unfinished_request_ids:  # nothing may keep a block after the server is gone
            self.engine.abort_request(rid)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as the steps produce them; the last one is finished.
        Bad input that only the engine can judge (a prompt too long for the pool) raises here, before the
        first output. Closing the generator early aborts the request."""
        self.start()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._pending.append((rid, prompt, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine never took it, or the step failed: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:  # the consumer left early: free its blocks before the next step
                self._aborts.add(rid)
                self._wake.set()

    async def _step_loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping and (self._pending or self._aborts or self.engine.has_unfinished_requests()):
                new, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, set()
                self._handing = len(new)  # they wait until a snapshot shows where they went
                results, snapshot = await asyncio.to_thread(self._step_in_thread, new, aborts)
                self.snapshot, self._handing = snapshot, 0  # together, in the event loop: never counted twice
                for rid, item in results:
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(item)
                if self.on_step is not None:
                    self.on_step(self.snapshot)

    def _step_in_thread(self, new, aborts) -> tuple[list[tuple[str, RequestOutput | BaseException]], EngineSnapshot]:
        """Everything that touches the engine: aborts, admissions, one step, a snapshot."""
        eng, results = self.engine, []
        unfinished = eng.output_processor.requests
        for rid in aborts:
            if rid in unfinished:
                eng.abort_request(rid)
        for rid, prompt, params in new:
            if rid in aborts:
                continue  # gone before it was ever added
            try:
                eng.add_request(rid, prompt, params)
            except (ValueError, TypeError) as e:
                results.append((rid, e))
        if eng.has_unfinished_requests():
            live = eng.unfinished_request_ids
            try:
                results += [(out.request_id, out) for out in eng.step()]
            except Exception as e:  # the engine has aborted every request and freed their blocks
                results += [(rid, RuntimeError(f"engine step failed: {type(e).__name__}: {e}")) for rid in live]
        sched = eng.scheduler
        snapshot = EngineSnapshot(len({s.group.group_id if s.group else s.request_id for s in sched.running}),
                                  len(sched.waiting), len(sched.swapped), eng.get_stats())  # fmt: skip
        return results, snapshot
