"""A request with several sequences (stage 11): n completions of one prompt, or the beams of a beam search.

Every sequence is an `InferenceSession` with a block table of its own; the group ties them together:

    parallel sampling (n = 3)            the prompt runs once, as one sequence ("r"); when its last prompt
                                         token is computed, the scheduler forks it into "r", "r#1", "r#2":
                                         the same blocks (reference count 3), three random streams, three
                                         tokens sampled from the same logits; from then on each decodes on
                                         its own, copying the shared last block before it writes into it
    beam search (width 4)                the running beams are sequences "r", "r#1", ...; after every step
                                         `BeamSearchState` picks the next beams: a beam that two of them
                                         continue is forked, one that none continues is freed

The scheduler keeps the group's running sequences next to each other in `running`, preempts them
together, and a beam that has computed its next-token log-probabilities waits (schedules nothing) until
its siblings have theirs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from roseinfer.beam_search import BeamSearchState
from roseinfer.outputs import CompletionOutput
from roseinfer.session import InferenceSession


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    seqs: list[InferenceSession]  # sampling: all n completions, in index order; beams: the running beams, best first
    beam: BeamSearchState | None = None  # set for beam search
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_seq_id(self) -> str:
        return f"{self.request_id}#{next(self._ids)}"

    @property
    def live(self) -> list[InferenceSession]:
        """The sequences still generating."""
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.beam.done if self.beam is not None else not self.live

    def completions(self, tokenizer) -> list[CompletionOutput]:
        """What the caller gets: the n completions, or the finished beams best first."""
        if self.beam is None:
            return [CompletionOutput(s.index, s.detokenizer.text, list(s.output_ids), s.finish_reason,
                                     s.cumulative_logprob) for s in self.seqs]  # fmt: skip
        eos = self.beam.eos_token_id
        out = []
        for i, h in enumerate(self.beam.finished):
            text = tokenizer.decode([t for t in h.token_ids if t != eos])
            reason = "stop" if h.token_ids and h.token_ids[-1] == eos else "length"
            out.append(CompletionOutput(i, text, list(h.token_ids), reason, h.cum_logprob))
        return out
