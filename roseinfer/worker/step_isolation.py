"""Failing alone: a step that raises is run again in halves, until the requests that make it fail are found.

The requests of a step are independent: each token attends only to its own request's K/V, and a row of
logits is sampled on its own. So a step over requests A B C D computes exactly what two steps over A B and
C D compute, and a request that makes the step raise (an out-of-memory on its long prompt, a value some
kernel cannot take, a bug that only its parameters reach) can be found by splitting:

    A B C D  raises ─► A B  ok: their tokens           C D  raises ─► C  ok: its token
                                                                      D  raises: D fails alone ("error")

The tokens of the halves that ran are merged into one ModelRunnerOutput, as if the step had run whole; the
requests that still fail alone are reported in `errors`, like the ones the runner could not set up, and the
scheduler frees them. A failed attempt leaves nothing behind that the next one trips over: the persistent
batch was updated once, before the first attempt; a forward that raised wrote K/V that the retry writes
again with the same values; tokens are written only once sampled.

What must stay together stays together (`units`): the n sequences of a request forked in this step sample
from their parent's row of logits; and a request admitted with a prefix-cache hit on blocks that another
request of the same step is writing reads them in that forward. That second tie also decides who else fails:
a block a failed request was to write holds garbage, so every request that reads it fails too, in this step
or (async scheduling) the next one (`Failures`), and the scheduler drops it from the prefix cache.

Not split: a tensor-parallel step (every rank must run the same forwards), and an error that comes after
the step's tokens were sampled (while they are copied to the host, or in the scheduler): those fail every
request of the engine, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from roseinfer.core.sched.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput

Span = tuple[Sequence[int], int, int]  # a request's block table, the first position it computes, how many


def spans(scheduler_output: SchedulerOutput, input_batch) -> dict[str, Span]:
    """Where each request of the step reads and writes K/V: its table, start (num_computed_tokens), count. A new
    request the runner could not add has no row: its table is in the step's message."""
    new = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
    out = {}
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        row = input_batch.req_id_to_row.get(rid)
        if row is not None:
            out[rid] = (input_batch.block_table.table[row], int(input_batch.num_computed_tokens[row]), n)
        elif rid in new:
            out[rid] = (new[rid].block_ids, new[rid].num_computed_tokens, n)
    return out


def written(span: Span, bs: int) -> list[int]:
    table, start, n = span
    return [int(b) for b in table[start // bs : -(-(start + n) // bs)]]


def read_only(span: Span, bs: int) -> list[int]:
    table, start, _ = span
    return [int(b) for b in table[: start // bs]]


def units(scheduler_output: SchedulerOutput, step_spans: dict[str, Span], bs: int) -> list[list[str]]:
    """The step's requests in groups that must run together: a request with the children it forks to sample now,
    and a request with the one that writes the cached blocks it reads (in the step's order)."""
    root = {rid: rid for rid in scheduler_output.num_scheduled_tokens}

    def find(r: str) -> str:
        while root[r] != r:
            r = root[r]
        return r

    for fork in scheduler_output.forks:
        if fork.sample_now and fork.parent_id in root:
            root[fork.child_id] = find(fork.parent_id)
    writer = {b: rid for rid, span in step_spans.items() for b in written(span, bs)}
    for rid, span in step_spans.items():
        for b in read_only(span, bs):
            w = writer.get(b)
            if w is not None and find(w) != find(rid):
                root[find(rid)] = find(w)
    groups: dict[str, list[str]] = {}
    for rid in root:
        groups.setdefault(find(rid), []).append(rid)
    return list(groups.values())


class Failures:
    """The requests that failed alone, until the scheduler frees them, and the blocks each was to write."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[str, set[int]] = {}  # failed request id -> K/V blocks left unwritten

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def __contains__(self, rid: str) -> bool:
        return rid in self.blocks

    def add(self, rids, step_spans: dict[str, Span]) -> None:
        for rid in rids:
            span = step_spans.get(rid)
            self.blocks[rid] = set(written(span, self.block_size)) if span is not None else set()

    def release(self, rid: str) -> None:
        self.blocks.pop(rid, None)

    def readers(self, step_spans: dict[str, Span]) -> dict[str, str]:
        """The requests of a step that read a block a failed request never wrote: request id -> that request."""
        bad = {b: rid for rid, blocks in self.blocks.items() for b in blocks}
        if not bad:
            return {}
        out = {}
        for rid, span in step_spans.items():
            hit = next((bad[b] for b in read_only(span, self.block_size) if b in bad), None)
            if hit is not None and rid not in self.blocks:
                out[rid] = hit
        return out


def without(scheduler_output: SchedulerOutput, ids) -> SchedulerOutput:
    """The step without some requests (and the forks of those): the part of it that runs."""
    cached = scheduler_output.scheduled_cached_reqs
    keep = [i for i, r in enumerate(cached.req_ids) if r not in ids]
    columns = (cached.req_ids, cached.resumed_from_preemption, cached.new_token_ids, cached.new_block_ids,
               cached.num_computed_tokens)  # fmt: skip
    num = {r: n for r, n in scheduler_output.num_scheduled_tokens.items() if r not in ids}
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return dataclasses.replace(
        scheduler_output,
        scheduled_new_reqs=[r for r in scheduler_output.scheduled_new_reqs if r.req_id not in ids],
        scheduled_cached_reqs=CachedRequestData(*([column[i] for i in keep] for column in columns)),
        num_scheduled_tokens=num,
        total_num_scheduled_tokens=sum(num.values()),
        scheduled_spec_decode_tokens={r: d for r, d in drafts.items() if r not in ids},
        forks=[f for f in scheduler_output.forks if f.child_id not in ids and f.parent_id not in ids],
    )


def run_in_parts(runner, scheduler_output: SchedulerOutput, error: Exception) -> ModelRunnerOutput:
    """The step `scheduler_output` raised `error` in `runner`: run its units again in halves, down to single units,
    merging what runs (each part through `runner.execute_part`); the units that still fail alone go in `errors`
    (and in `runner.failures`, with the blocks they left unwritten)."""
    out = ModelRunnerOutput()
    step_spans = spans(scheduler_output, runner.input_batch)
    parts = [units(scheduler_output, step_spans, runner.block_size)]
    everyone = {r for u in parts[0] for r in u}
    while parts:
        part = parts.pop()
        ids = {r for u in part for r in u}
        try:
            if len(part) == 1 and not parts and ids == everyone:
                raise error  # the whole step was this one unit: it has failed already
            merge(out, runner.execute_part(without(scheduler_output, everyone - ids)))
        except Exception as e:
            if len(part) > 1:
                parts += [part[len(part) // 2 :], part[: len(part) // 2]]  # the first half runs first
                continue
            runner.failures.add(ids, step_spans)
            out.errors.update({r: error_message(r, e) for r in ids})
    return out


def merge(into: ModelRunnerOutput, out: ModelRunnerOutput) -> None:
    """Add one part's output to the step's."""
    into.req_ids += out.req_ids
    into.sampled_token_ids += out.sampled_token_ids
    for name in ("logprobs", "prompt_logprobs", "candidates", "spec_token_ids", "errors"):
        getattr(into, name).update(getattr(out, name))


def error_message(req_id: str, e: BaseException) -> str:
    """The error a request that failed alone reports."""
    return f"request {req_id!r} failed in the model runner: {type(e).__name__}: {e}"
