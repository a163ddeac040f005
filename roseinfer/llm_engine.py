"""LLMEngine: the online API (vLLM's names). Requests come and go while it runs.

    engine = LLMEngine(max_num_seqs=8)
    engine.add_request("a", "Romeo.\\n", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one scheduler step: admit, prefill, batched decode
            print(out.request_id, repr(out.delta), out.finished)
        if time_for_more: engine.add_request("b", "Juliet.\\n")   # joins the running batch next step

Each `step()` asks the `Scheduler` for a batch (newly admitted requests + everything
running), runs it through `InferenceEngine.step_sessions`, and returns one RequestOutput
per request that ran, with the text that became final in this step (`delta`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from roseinfer.checks import check_int
from roseinfer.engine import InferenceEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.scheduler import Scheduler
from roseinfer.session import InferenceSession


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
    ):
        check_int("max_num_seqs", max_num_seqs)  # before loading anything
        self.engine = InferenceEngine(
            model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend,
        )  # fmt: skip
        self.tokenizer = self.engine.tokenizer
        self.block_manager = self.engine.make_block_manager()
        self.engine.kv_cache_for(self.block_manager)  # allocate the KV pool now
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs)
        self.sessions: dict[str, InferenceSession] = {}  # unfinished requests by id
        self.trace: list[dict] | None = None  # set to [] to record every step (notebooks, examples)
        self.num_steps = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. Bad input (and a prompt that can never fit the KV pool) raises here."""
        if request_id in self.sessions:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        session = self.engine.new_session(request_id, prompt, params or SamplingParams())
        self.scheduler.add(session)
        self.sessions[request_id] = session

    def abort_request(self, request_id: str) -> None:
        """Stop a waiting or running request now and give its KV blocks back."""
        if request_id not in self.sessions:
            raise KeyError(f"cannot abort unknown request id {request_id!r} (finished requests are forgotten)")
        self._retire(self.sessions[request_id], reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.sessions)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that ran."""
        try:
            batch = self.scheduler.schedule()
            self.engine.step_sessions(batch, self.block_manager)
        except BaseException:
            for s in list(self.sessions.values()):  # a failed forward: fail every request, leak no block
                self._retire(s, reason="abort")
            raise
        outputs = [s.output(delta=s.last_delta) for s in batch]
        for s in batch:
            if s.finished:
                self._retire(s)
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append(self._trace_entry(batch))
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

    def _retire(self, session: InferenceSession, reason: str | None = None) -> None:
        if reason and not session.finished:
            session.finish_reason = reason
        self.scheduler.finish(session)
        self.sessions.pop(session.request_id, None)

    def _trace_entry(self, batch: list[InferenceSession]) -> dict:
        ran = [s.request_id for s in batch]
        return {
            "step": self.num_steps,
            "ran": ran,
            "finished": [s.request_id for s in batch if s.finished],
            "waiting": [s.request_id for s in self.scheduler.waiting],
            "running": [s.request_id for s in self.scheduler.running],
            "preemptions": self.scheduler.num_preemptions,
            **self.block_manager.snapshot(),
        }
