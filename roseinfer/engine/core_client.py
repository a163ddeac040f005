"""EngineCoreClient: the one door from the engine to the engine core (vLLM V1's `EngineCoreClient`).

    LLMEngine / AsyncLLMEngine / server / examples / benchmarks
        │  add_request(Request)   abort_requests([ids])   step()   get_stats()   ...
        ▼
    EngineCoreClient ── InprocClient: the core is an object in this process
        │
        ▼
    EngineCore (roseinfer/engine/core.py): Scheduler + KVCacheManager + model runner

Everything that crosses this door is data: a `Request` of token ids going in, `EngineCoreOutput`s of token
ids and the step's `SchedulerOutput` coming out, counters as a dict. Nothing in front of the door holds the
scheduler, the KV cache manager or the model runner, so nothing there can depend on how they work inside.
That is what lets vLLM put the core in a process of its own (`SyncMPClient`: the same methods, sent over a
socket) without changing the engine in front of it. Here there is one implementation, in-process; a test
(tests/test_16_engine_core.py) checks that no module in front of the door imports what is behind it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from roseinfer.config import EngineConfig
from roseinfer.core.request import Request
from roseinfer.core.sched.output import EngineCoreOutput, SchedulerOutput
from roseinfer.engine.core import EngineCore


class EngineCoreClient(ABC):
    """What the engine may ask of the core. Every method takes and returns data."""

    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        """The client for this config (vLLM picks in-process or multiprocess here; roseinfer has one)."""
        return InprocClient(config)

    @abstractmethod
    def get_config(self) -> EngineConfig:
        """The final config: the one given, with the KV pool's size that the core determined."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request (its checks are done: see `check_fits`)."""

    @abstractmethod
    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never fit the KV pool; queue nothing."""

    @abstractmethod
    def has_request(self, request_id: str) -> bool:
        """Whether a sequence with this id is unfinished in the core."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End every sequence of each caller's request now and give their blocks back."""

    @abstractmethod
    def finish_requests(self, sequence_ids: Iterable[str], reason: str) -> None:
        """End these sequences now with `reason` (e.g. "stop": the output processor found a stop string)."""

    @abstractmethod
    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Run one step: the step's data-only message and the token ids it produced."""

    @abstractmethod
    def get_stats(self) -> dict:
        """Counters and queue lengths (vLLM's names), cheap enough to read after every step."""

    @abstractmethod
    def get_scheduler_state(self) -> dict:
        """Who waits, runs and is swapped out, and a copy of the KV books (traces, examples, pictures)."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay)."""

    @abstractmethod
    def apply_model(self, fn: Callable):
        """`fn(model)` on this process's model (rank 0 with tensor parallelism), as vLLM's `LLM.apply_model`."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop whatever the core started (tensor-parallel workers)."""


class InprocClient(EngineCoreClient):
    """The core as a plain object in this process: each method is a call. `engine_core` is the core itself,
    for tests and for examples that show what happens inside a step (vLLM's InprocClient has the same field)."""

    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)
        self.step = self.engine_core.step  # the call of every step goes straight to the core: no hop through here

    def get_config(self) -> EngineConfig:
        return self.engine_core.config

    def add_request(self, request: Request) -> None:
        self.engine_core.add_request(request)

    def check_fits(self, request: Request) -> None:
        self.engine_core.check_fits(request)

    def has_request(self, request_id: str) -> bool:
        return self.engine_core.has_request(request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.engine_core.abort_request(rid)

    def finish_requests(self, sequence_ids: Iterable[str], reason: str) -> None:
        self.engine_core.finish_requests(sequence_ids, reason)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        return self.engine_core.step()

    def get_stats(self) -> dict:
        return self.engine_core.get_stats()

    def get_scheduler_state(self) -> dict:
        return self.engine_core.get_scheduler_state()

    def reset_prefix_cache(self) -> None:
        self.engine_core.reset_prefix_cache()

    def apply_model(self, fn: Callable):
        return self.engine_core.apply_model(fn)

    def shutdown(self) -> None:
        self.engine_core.close()
