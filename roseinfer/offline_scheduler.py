"""The stage-03 scheduler: start every request at once and step them all until they are done.

Every `step()` walks the unfinished sessions in the order they arrived and advances each by one
token (round-robin). A request's first turn is its prefill, the next ones are single-token decodes:

    step 1:  A(prefill) B(prefill) C(prefill)
    step 2:  A B C
    step 3:  A   C          (B finished: it simply drops out)

Stage 04 adds the block manager: a session's first turn allocates blocks for its prompt, each later
turn one slot for the token it feeds, and a finished session gives its blocks back at once. A session
that cannot get a block waits for a later step. Stage 05: the sessions that decode in a step share ONE
batched forward pass. Stage 09: the whole step (prefills and decodes) is one `SchedulerOutput` and one
forward pass in the model runner. Continuous batching is `roseinfer/scheduler.py`.
Stage 12 moved this class here from `roseinfer/scheduler.py`, which still exports it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from roseinfer.block_manager import AllocStatus, BlockSpaceManager
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.session import InferenceSession

if TYPE_CHECKING:
    from roseinfer.engine import InferenceEngine


class KVCacheFullError(RuntimeError):
    pass


class OfflineScheduler:
    def __init__(self, engine: InferenceEngine, block_manager: BlockSpaceManager | None = None, trace: bool = False):
        self.engine = engine
        self.block_manager = block_manager or engine.make_block_manager()
        self.model_runner = engine.make_runner(self.block_manager)
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
            sched = SchedulerOutput(batch, {s.request_id: s.num_tokens - s.num_computed_tokens for s in batch},
                                    self.block_manager.block_tables)  # fmt: skip
            sampled = self.model_runner.execute_model(sched).sampled  # prefills and decodes: ONE forward
            for session in batch:
                session.num_computed_tokens = session.num_tokens
                session.append_token(sampled[session.request_id])
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
