"""The scheduler's view of the model runner's persistent batch: what the runner already holds, so that each
step tells it only what changed.

The runner keeps a row per request (token ids, block table, sampling parameters) from the step it first
sees the request until the scheduler says it finished. So for every request a step schedules, this class
decides which message it needs:

    first time                 NewRequestData: prompt ids, params, the whole block table
    preempted since it last ran   a cached entry, `resumed`, with the whole (new) block table
    otherwise                  a cached entry: num_computed_tokens, the table's changed tail if any (usually
                               nothing: a decode crosses into a new block once in block_size steps), and
                               tokens the runner did not sample itself (chosen from its candidates)

The KV cache manager keeps no record of what the runner was told: each of its calls that changes a table
returns what it did (a `KVCacheBlocks`), and the scheduler hands that to `record_blocks`. This class keeps,
per sequence, the first table index the runner has not seen since the sequence last ran:

    step 1  allocate_slots(A) -> changed_from 0    A is new: the whole table [7, 2]
    step 2  allocate_slots(A) -> no change         nothing about A's blocks
    step 5  allocate_slots(A) -> changed_from 2    (2, [9]): the runner appends block 9

and it collects, between steps, the forks (a child starts as a copy of its parent's row) and the ids of
finished requests (the runner drops their rows).
"""

from __future__ import annotations

from roseinfer.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from roseinfer.core.request import Request
from roseinfer.core.sched.output import ForkedRequest, NewRequestData, SchedulerOutput


class RunnerView:
    def __init__(self, kv_cache_manager: KVCacheManager):
        self.kv = kv_cache_manager  # the block tables: read when a message carries one
        self.seen: set[str] = set()  # sequences the runner holds a row for
        self.resumed: set[str] = set()  # preempted since they last ran: their next step sends a whole table
        self.unseen_from: dict[str, int] = {}  # seq id -> first table index changed since the runner last saw it
        self.new_token_ids: dict[str, list[int]] = {}  # tokens appended outside the runner's sampler
        self.forks: list[ForkedRequest] = []  # forks made between steps (`Scheduler.update_group`)
        self.finished_ids: set[str] = set()  # rows to drop, since the last step

    def start_step(self, out: SchedulerOutput) -> None:
        """The forks and finished ids gathered since the last step go with this one."""
        out.forks, out.finished_req_ids = self.forks, self.finished_ids
        self.forks, self.finished_ids = [], set()

    def record_blocks(self, seq_id: str, blocks: KVCacheBlocks) -> None:
        """A table changed (what `allocate_slots` or `trim` returned): the runner learns it at the next step."""
        index = blocks.changed_from
        if index is not None:
            old = self.unseen_from.get(seq_id)
            if old is None or index < old:
                self.unseen_from[seq_id] = index

    def pop_block_update(self, seq_id: str) -> tuple[int, list[int]] | None:
        """(j, table[j:]) if the sequence's table changed from index j on since the runner last saw it, else None."""
        j = self.unseen_from.pop(seq_id, None)
        return None if j is None else (j, self.kv.block_tables[seq_id][j:])

    def _whole_table(self, seq_id: str) -> list[int]:
        """The whole table (a new, resumed or forked sequence): the runner is then up to date with it."""
        self.unseen_from.pop(seq_id, None)
        return list(self.kv.block_tables[seq_id])

    def add_scheduled(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """What the runner is told about a request scheduled for `n` tokens this step."""
        rid = req.request_id
        out.num_scheduled_tokens[rid] = n
        out.total_num_scheduled_tokens += n
        if rid not in self.seen:
            self.seen.add(rid)
            self.resumed.discard(rid)
            table = self._whole_table(rid)
            p, computed = req.sampling_params, req.num_computed_tokens
            out.scheduled_new_reqs.append(
                NewRequestData(rid, req.prompt_token_ids, p, table, computed, req.num_candidates)
            )
            return
        resumed = rid in self.resumed
        if resumed:
            self.resumed.discard(rid)
            blocks = (0, self._whole_table(rid))
        else:
            blocks = self.pop_block_update(rid)
        cached = out.scheduled_cached_reqs
        cached.req_ids.append(rid)
        cached.resumed_from_preemption.append(resumed)
        cached.new_token_ids.append(self.new_token_ids.pop(rid, ()) if self.new_token_ids else ())
        cached.new_block_ids.append(blocks)
        cached.num_computed_tokens.append(req.num_computed_tokens)

    def fork(self, parent: Request, child: Request, sample_now: bool) -> ForkedRequest:
        """A child the runner will copy from its parent's row (its block table: the shared one, as it is now)."""
        self.seen.add(child.request_id)
        if parent.request_id in self.new_token_ids:  # tokens the parent's row lacks: the child's lacks them too
            self.new_token_ids[child.request_id] = list(self.new_token_ids[parent.request_id])
        table = self._whole_table(child.request_id)
        return ForkedRequest(parent.request_id, child.request_id, child.index, table, sample_now)

    def preempt(self, rid: str) -> None:
        """A sequence was preempted (its blocks freed or swapped out): its next step sends a whole table."""
        self.resumed.add(rid)
        self.unseen_from.pop(rid, None)

    def release(self, rid: str) -> None:
        """A sequence finished: its row goes at the next step."""
        self.resumed.discard(rid)
        self.unseen_from.pop(rid, None)
        self.new_token_ids.pop(rid, None)
        if rid in self.seen:
            self.seen.discard(rid)
            self.finished_ids.add(rid)
        if self.forks:
            self.forks = [f for f in self.forks if f.child_id != rid]
