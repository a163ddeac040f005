"""Schedulers: which requests run at each step.

`OfflineScheduler` (stages 03-05) starts every request at once and steps them until all
are done. `Scheduler` (stage 06, below) does continuous batching.

Stage 03 keeps it simple: every `step()` walks the unfinished sessions in the order
they arrived and advances each by one token (round-robin). A request's first turn is
its prefill, the next ones are single-token decodes:

    step 1:  A(prefill) B(prefill) C(prefill)
    step 2:  A B C
    step 3:  A   C          (B finished: it simply drops out)

Stage 04 adds the block manager: a session's first turn allocates blocks for its
prompt, each later turn one slot for the token it feeds, and a finished session gives
its blocks back at once. A session that cannot get a block waits for a later step.

Stage 05: the sessions that decode in a step share ONE batched forward pass
(`InferenceEngine.step_sessions`); only prefills still run one by one.
"""

from __future__ import annotations

import itertools
from collections import deque

from roseinfer.block_manager import AllocStatus, BlockSpaceManager
from roseinfer.engine import InferenceEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.session import InferenceSession


class KVCacheFullError(RuntimeError):
    pass


class OfflineScheduler:
    def __init__(self, engine: InferenceEngine, block_manager: BlockSpaceManager | None = None, trace: bool = False):
        self.engine = engine
        self.block_manager = block_manager or engine.make_block_manager()
        self.sessions: dict[str, InferenceSession] = {}  # insertion order = arrival order
        self.trace: list[dict] | None = [] if trace else None  # block tables after each step
        self.num_steps = 0
        self._ids = itertools.count()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Check and queue a request; bad input raises here and leaves the queue untouched."""
        request_id = str(next(self._ids))
        session = self.engine.new_session(request_id, prompt, params or SamplingParams())
        bm = self.block_manager
        if bm.can_allocate(len(session.prompt_ids)) is AllocStatus.NEVER:
            raise ValueError(
                f"prompt needs {bm.blocks_for(len(session.prompt_ids))} KV blocks of {bm.block_size} tokens, "
                f"but the whole KV cache pool has {bm.num_blocks}"
            )
        self.sessions[request_id] = session
        return request_id

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.sessions.values())

    def step(self) -> list[str]:
        """Advance every unfinished session that can get its KV slots by one token; return the ids that ran."""
        ran = []
        try:
            batch = [s for s in self.sessions.values() if not s.finished and self._reserve_slots(s)]
            self.engine.step_sessions(batch, self.block_manager)  # prefills, then ONE batched decode
            for session in batch:
                ran.append(session.request_id)
                if session.finished:
                    self.block_manager.free(session.request_id)
            if not ran and self.has_unfinished():
                bm = self.block_manager
                raise KVCacheFullError(
                    f"KV cache pool exhausted: all {bm.num_blocks} blocks are held by unfinished requests that "
                    f"each need one more; give the engine more KV memory (num_blocks / kv_cache_memory)"
                )
        except BaseException:
            self.free_all()
            raise
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append({"step": self.num_steps, "ran": ran, **self.block_manager.snapshot()})
        return ran

    def _reserve_slots(self, session: InferenceSession) -> bool:
        """Book the KV slots this turn writes: the prompt at prefill, one token per decode."""
        bm, rid = self.block_manager, session.request_id
        if rid not in bm.block_tables:
            if bm.can_allocate(len(session.prompt_ids)) is not AllocStatus.OK:
                return False  # LATER: wait until someone finishes
            bm.allocate(rid, len(session.prompt_ids))
            return True
        if not bm.can_append_slot(rid):
            return False
        bm.append_slot(rid)
        return True

    def free_all(self) -> None:
        """Give back every block this scheduler's sessions hold (after an error)."""
        for rid in self.sessions:
            self.block_manager.free(rid)

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; return {request_id: output}."""
        while self.has_unfinished():
            self.step()
        return {rid: s.output() for rid, s in self.sessions.items()}


class Scheduler:
    """Continuous batching (stage 06): requests join and leave the batch at every step.

    Two queues, as in vLLM. `waiting`: requests not running (new, or preempted), FCFS.
    `running`: requests that hold KV blocks and decode one token per step. Each `schedule()`:

      1. books one KV slot for every running request, oldest first. When the pool has no
         free block, the most recently admitted running request is *preempted* (stage 07):
         its blocks go back and it returns to the front of `waiting`; when readmitted it
         recomputes its K/V (prompt + what it generated) in one prefill and carries on;
      2. admits waiting requests, oldest first, while fewer than `max_num_seqs` run and the
         block manager answers OK (LATER: stop admitting, wait a step). Nothing is admitted
         in a step that had to preempt;
      3. returns the batch: newly admitted (to prefill) + running (to decode).

    The caller runs the batch and calls `finish()` for requests that ended: their blocks
    go back at once and their batch slots are free for the next step's admissions.
    """

    def __init__(self, block_manager: BlockSpaceManager, max_num_seqs: int = 64):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[InferenceSession] = deque()
        self.running: list[InferenceSession] = []
        self.num_preemptions = 0

    def add(self, session: InferenceSession) -> None:
        """Queue a request. One that could not fit the pool even alone (prompt + max_tokens) fails here."""
        bm = self.block_manager
        n = min(session.num_tokens + session.params.max_tokens, session.max_context)
        if bm.blocks_for(n) > bm.num_blocks:
            raise ValueError(
                f"request needs up to {bm.blocks_for(n)} KV blocks of {bm.block_size} tokens "
                f"({len(session.prompt_ids)} prompt + {n - len(session.prompt_ids)} new tokens), "
                f"but the whole KV cache pool has {bm.num_blocks}"
            )
        self.waiting.append(session)

    def schedule(self) -> list[InferenceSession]:
        """Pick this step's batch (see the class docstring)."""
        bm = self.block_manager
        decoding, preempted = [], False
        for session in list(self.running):  # oldest first
            if session not in self.running:
                continue  # preempted earlier in this loop
            while not bm.can_append_slot(session.request_id):
                self._preempt(self.running[-1])  # the youngest gives its blocks back
                preempted = True
                if session not in self.running:
                    break
            else:
                bm.append_slot(session.request_id)
                decoding.append(session)
        admitted = []
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            session = self.waiting[0]
            if bm.can_allocate(session.num_tokens) is not AllocStatus.OK:
                break  # FCFS: nobody overtakes the oldest waiting request
            bm.allocate(session.request_id, session.num_tokens)
            self.running.append(self.waiting.popleft())
            admitted.append(session)
        return admitted + decoding

    def _preempt(self, session: InferenceSession) -> None:
        """Preempt by recompute: drop the K/V, keep the tokens, go back to the front of the queue."""
        self.block_manager.free(session.request_id)
        self.running.remove(session)
        session.num_computed_tokens = 0
        self.waiting.appendleft(session)
        self.num_preemptions += 1

    def finish(self, session: InferenceSession) -> None:
        """A request ended (or was aborted): free its blocks and its place in the batch."""
        self.block_manager.free(session.request_id)
        if session in self.running:
            self.running.remove(session)
        elif session in self.waiting:
            self.waiting.remove(session)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
