"""The sequences of one request, scheduled as one (n > 1 completions, the beams of a beam search).

A request with a `RequestGroup` runs as several sequences, "r", "r#1", "r#2", ... They stand side by side in
`running` (and in `swapped`), so the scheduler finds them from the first one's index, gives each the tokens it
lacks, and books their slots, preempts them and swaps them back together:

    running  [A, r, r#1, r#2, B]      sequences_at(running, 1)  ->  [r, r#1, r#2]
    tokens_per_sequence([r, r#1, r#2], budget 64)  ->  [(r, 1), (r#1, 1), (r#2, 1)]

A waiting request takes as many places in `running` as it will run sequences (`num_sequences_admitted`): n
for parallel sampling (it forks after its prompt), the beam width for a beam search that has not started.
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.core.request import Request


def sequences_at(queue: Sequence[Request], i: int) -> list[Request]:
    """The sequences of one request, side by side in a queue from index i (one, unless it has a group)."""
    seqs, group = [queue[i]], queue[i].group
    while group is not None and i + len(seqs) < len(queue) and queue[i + len(seqs)].group is group:
        seqs.append(queue[i + len(seqs)])
    return seqs


def tokens_per_sequence(seqs: list[Request], budget: int) -> list[tuple[Request, int]]:
    """The tokens each sequence of a request computes this step, within the budget: what it still lacks (0 for
    a beam that waits for its siblings' log-probabilities). Sequences with nothing to compute are left out."""
    work = []
    for s in seqs:
        n = (
            0
            if s.last_token_in_flight
            else min(s.num_tokens + s.num_output_placeholders - s.num_computed_tokens, budget)
        )
        if n:
            work.append((s, n))
            budget -= n
    return work


def max_num_running_seqs(req: Request) -> int:
    """The sequences a request runs at most (vLLM's get_max_num_running_seqs): n, or the beam width."""
    p = req.sampling_params
    return p.beam_width if req.is_beam else p.n


def num_sequences_admitted(req: Request) -> int:
    """Places in `running` a waiting request will take: n for parallel sampling, beam_width for a search
    that has not started; a sequence of a group that was preempted comes back on its own."""
    group = req.group
    if group is None:
        return req.sampling_params.n
    if req.is_beam and req.num_output_tokens == 0 and len(group.seqs) == 1:
        return group.num_seqs
    return 1
