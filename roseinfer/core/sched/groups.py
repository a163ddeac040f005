"""The sequences of one request, scheduled as one (n > 1 completions, the beams of a beam search).

A request with a `RequestGroup` runs as several sequences, "r", "r#1", "r#2", ... They stand side by side in
`running` (and in `swapped`), so the scheduler finds them from the first one's index, gives each the tokens it
lacks, and books their slots, preempts them and swaps them back together:

    running  [A, r, r#1, r#2, B]      sequences_at(running, 1)  ->  [r, r#1, r#2]
    tokens_per_sequence([r, r#1, r#2], budget 64)  ->  [(r, 1), (r#1, 1), (r#2, 1)]

A waiting request takes as many places in `running` as it will run sequences (`num_sequences_admitted`): n
for parallel sampling (it forks after its prompt), its group's `num_seqs` for one queued with a group (a beam
search) that has not forked yet.

A group whose next tokens are chosen outside the runner (a beam search) reports its sequences' candidates
once every one of them has its own and has computed all its tokens (`ready_candidates`).
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.core.request import Request
from roseinfer.core.sched.output import EngineCoreOutput


def sequences_at(queue: Sequence[Request], i: int) -> list[Request]:
    """The sequences of one request, side by side in a queue from index i (one, unless it has a group)."""
    seqs, group = [queue[i]], queue[i].group
    while group is not None and i + len(seqs) < len(queue) and queue[i + len(seqs)].group is group:
        seqs.append(queue[i + len(seqs)])
    return seqs


def tokens_per_sequence(seqs: list[Request], budget: int) -> list[tuple[Request, int]]:
    """The tokens each sequence of a request computes this step, within the budget: what it still lacks (0 for
    a sequence whose candidates wait for its siblings'). Sequences with nothing to compute are left out."""
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
    """The sequences a request runs at most (vLLM's get_max_num_running_seqs): n, or its group's size."""
    return req.group.num_seqs if req.group is not None else req.sampling_params.n


def num_sequences_admitted(req: Request) -> int:
    """Places in `running` a waiting request will take: n for parallel sampling, its group's size for one
    queued with a group that has not forked yet; a sequence of a group that was preempted comes back on its own."""
    group = req.group
    if group is None:
        return req.sampling_params.n
    if req.num_output_tokens == 0 and len(group.seqs) == 1:
        return group.num_seqs
    return 1


def ready_candidates(requests: dict[str, Request], candidates: dict) -> list[EngineCoreOutput]:
    """Keep each sequence's candidates (request id -> (token ids, log-probabilities)); report, per group, all of
    them once every running sequence of the group has its own and has computed all its tokens."""
    groups = []
    for rid, cands in candidates.items():
        req = requests.get(rid)
        if req is not None:
            req.candidates = cands
            if req.group not in groups:
                groups.append(req.group)
    return [
        EngineCoreOutput(g.group_id, [], candidates={s.request_id: s.candidates for s in g.seqs})
        for g in groups
        if all(s.candidates is not None and s.num_computed_tokens == s.num_tokens for s in g.seqs)
    ]


def side_by_side(queue: list[Request], seqs: list[Request]) -> None:
    """Put those of `seqs` that are in `queue` side by side, in their order, where the first of them stands."""
    members = set(seqs)  # the Request objects themselves (a set by identity)
    at = next((i for i, r in enumerate(queue) if r in members), None)
    if at is not None:
        rest = [r for r in queue if r not in members]
        queue[:] = rest[:at] + [s for s in seqs if s in queue] + rest[at:]
