"""The offline scheduler: many requests, one engine.

Stage 03 keeps it simple: every `step()` walks the unfinished sessions in the order
they arrived and advances each by one token (round-robin). A request's first turn is
its prefill, the next ones are single-token decodes:

    step 1:  A(prefill) B(prefill) C(prefill)
    step 2:  A B C
    step 3:  A   C          (B finished: it simply drops out)

Requests take turns, but each forward pass still carries a single sequence, so the
total work is the same as running them one after another. Stage 05 batches them.
"""

from __future__ import annotations

import itertools

from roseinfer.engine import InferenceEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.session import InferenceSession


class OfflineScheduler:
    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self.sessions: dict[str, InferenceSession] = {}  # insertion order = arrival order
        self._ids = itertools.count()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Check and queue a request; bad input raises here and leaves the queue untouched."""
        request_id = str(next(self._ids))
        self.sessions[request_id] = self.engine.new_session(request_id, prompt, params or SamplingParams())
        return request_id

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.sessions.values())

    def step(self) -> list[str]:
        """Advance every unfinished session by one token; return the ids that ran."""
        ran = []
        for session in self.sessions.values():
            if not session.finished:
                self.engine.step_session(session)
                ran.append(session.request_id)
        return ran

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; return {request_id: output}."""
        while self.has_unfinished():
            self.step()
        return {rid: s.output() for rid, s in self.sessions.items()}
