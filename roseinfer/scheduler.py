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

Stage 05: the sessions that decode in a step share ONE batched forward pass; only
prefills still ran one by one. Stage 09: both schedulers hand their step to the model runner
as a `SchedulerOutput`, and the whole step (prefills and decodes) is one forward pass.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

import torch

from roseinfer.block_manager import AllocStatus, BlockSpaceManager
from roseinfer.checks import check_int
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.sequence_group import SequenceGroup
from roseinfer.session import InferenceSession

if TYPE_CHECKING:
    from roseinfer.engine import InferenceEngine
    from roseinfer.model_runner import ModelRunnerOutput


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


class Scheduler:
    """Continuous batching (stage 06) under a token budget (stage 09), as in vLLM v1.

    Two queues. `waiting`: requests not running (new, or preempted), FCFS. `running`: requests
    that hold KV blocks. There are no prefill and decode phases: a request has `num_tokens` (prompt
    + generated) and `num_computed_tokens` (those whose K/V are in the cache), and each step hands
    out at most `max_num_batched_tokens` tokens of work:

      1. running requests first, oldest first: each gets what it still lacks, which is one token
         for a decode, or the rest of a prompt (a chunk of it if the budget is short). Its KV slots
         are booked; when the pool is out of blocks the youngest running request is preempted by
         recompute (stage 07: blocks freed, back to the front of `waiting`, num_computed_tokens 0);
      2. then waiting requests, oldest first, while fewer than `max_num_seqs` run, tokens are
         left and the block manager can book the slots (else wait: nobody overtakes). With
         `enable_chunked_prefill` a prompt longer than the tokens left is cut: its first chunk now,
         the rest in later steps. Nothing is admitted in a step that had to preempt. Stage 10:
         with prefix caching, the longest run of a request's first full blocks that is already in
         the cache is shared, and it starts with num_computed_tokens past them;
      3. the result is a `SchedulerOutput`; after the model runner has run it,
         `update_from_output` advances every request and appends the sampled tokens.

        budget 64, running A B (decoding), C (prompt of 100, 48 computed), waiting D (prompt 30)
        step:  A 1 · B 1 · C 52 (its rest) · D 10 (a first chunk)     = 64 tokens, one forward
    """

    def __init__(
        self,
        block_manager: BlockSpaceManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
    ):
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        if not enable_chunked_prefill and max_model_len and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than the model's context "
                f"({max_model_len}): without chunked prefill a long prompt could never be scheduled; "
                f"raise max_num_batched_tokens or set enable_chunked_prefill=True"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[InferenceSession] = deque()
        self.running: list[InferenceSession] = []
        self.num_preemptions = 0
        self._preempted: set[str] = set()  # ids that were preempted and have not run since
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache (stage 10)
        self.prefix_cache_hits = 0  # ... and found there

    def add(self, session: InferenceSession) -> None:
        """Queue a request. One that could not fit the pool even alone (prompt + max_tokens) fails here."""
        bm, seqs = self.block_manager, self._seats(session)
        if seqs > self.max_num_seqs:
            raise ValueError(
                f"request asks for {seqs} sequences (n / beam_width) but max_num_seqs is {self.max_num_seqs}"
            )
        n = min(session.num_tokens + session.params.max_tokens, session.max_context)
        # stage 11: n sequences share the prompt's blocks; each needs its own for the rest (+1 copied on write)
        need = bm.blocks_for(n) + (seqs - 1) * (bm.blocks_for(n - session.num_tokens) + 1)
        if need > bm.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks of {bm.block_size} tokens "
                f"({len(session.prompt_ids)} prompt + {n - len(session.prompt_ids)} new tokens, {seqs} sequence(s)), "
                f"but the whole KV cache pool has {bm.num_blocks}"
            )
        self.waiting.append(session)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the class docstring)."""
        bm, budget = self.block_manager, self.max_num_batched_tokens
        scheduled, num_new, preempted, forks = [], {}, [], []
        for session in list(self.running):  # oldest first
            if budget == 0:
                break  # out of tokens: the rest wait one step (they keep their blocks)
            if session not in self.running:
                break  # preempted below: it and everyone after it are gone
            n = min(session.num_tokens - session.num_computed_tokens, budget)
            if n == 0:
                continue  # stage 11: a beam with its next-token log-probabilities, waiting for its siblings
            while not bm.allocate_slots(session.request_id, n, self._block_hashes(session)):
                victims = self._preempt(self.running[-1])  # the youngest request gives its blocks back
                preempted += [v.request_id for v in victims]
                if session in victims:
                    break
            else:
                scheduled.append(session)
                num_new[session.request_id] = n
                budget -= n
                self._fork_if_sampling_n(session, n, forks)
        new, resumed = [], []
        while not preempted and self.waiting and budget > 0:
            session = self.waiting[0]
            if len(self.running) + self._seats(session) > self.max_num_seqs:
                break  # stage 11: a request with n sequences needs n places
            hashes = self._block_hashes(session)
            hits = bm.find_cached_blocks(hashes, session.num_tokens)  # stage 10: a cached prefix is shared
            num_cached = len(hits) * bm.block_size
            n = session.num_tokens - num_cached
            if n > budget and not self.enable_chunked_prefill:
                break  # the whole prompt does not fit this step's budget: wait for a step with room
            n = min(n, budget)
            if not bm.allocate_slots(session.request_id, n, hashes, hits):
                break  # LATER: FCFS, nobody overtakes the oldest waiting request
            session.num_computed_tokens = num_cached  # the shared blocks' K/V are there: start after them
            if session.request_id not in self._preempted:
                session.num_cached_tokens = num_cached
            self.prefix_cache_queries += session.num_tokens
            self.prefix_cache_hits += num_cached
            self.running.append(self.waiting.popleft())
            (resumed if session.request_id in self._preempted else new).append(session.request_id)
            self._preempted.discard(session.request_id)
            scheduled.append(session)
            num_new[session.request_id] = n
            budget -= n
            self._fork_if_sampling_n(session, n, forks)
        copies, bm.blocks_to_copy = bm.blocks_to_copy, []  # stage 11: copy-on-write, before the forward
        return SchedulerOutput(scheduled, num_new, bm.block_tables, new, resumed, preempted, forks, copies)

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[InferenceSession]:
        """After the forward: count the computed tokens, append the sampled ones, and let beam searches whose
        beams all have their log-probabilities take a step. Returns the sequences that got a token (some
        may now be finished; the caller retires those with `finish`), and the first beam of a finished search."""
        for session in sched.scheduled:
            session.num_computed_tokens += sched.num_scheduled_tokens[session.request_id]
        for parent, child in sched.forks:  # stage 11: forked this step, they share what the parent computed
            child.num_computed_tokens = parent.num_computed_tokens
        produced, searches = [], {}
        for session in [*sched.scheduled, *(child for _, child in sched.forks)]:
            rid = session.request_id
            if rid in out.beam_logprobs:  # a beam: keep its distribution for the search's next step
                session.pending_logprobs = out.beam_logprobs[rid]
                searches[id(session.group)] = session.group
            elif rid in out.sampled:
                session.cumulative_logprob += out.logprobs.get(rid, 0.0)
                session.append_token(out.sampled[rid])
                produced.append(session)
        for group in searches.values():
            if all(s.pending_logprobs is not None for s in group.seqs):
                first = group.seqs[0]
                self._beam_step(group)
                if group.beam.done:
                    produced.append(first)  # its group tells the caller the search is over
        return produced

    def _seats(self, session: InferenceSession) -> int:
        """Places in `running` a waiting request will take: n for parallel sampling, beam_width for a search."""
        group = session.group
        if group is not None and (group.beam is None or session.output_ids):
            return 1  # a sequence of a group that was preempted: it comes back on its own
        return group.beam.beam_width if group is not None else session.params.n

    def _fork_if_sampling_n(self, session: InferenceSession, n: int, forks: list) -> None:
        """Stage 11: a request with n > 1 completions runs its prompt once; in the step that computes the
        last prompt token it is forked into n sequences that share its blocks, and each samples its own token
        from the same logits (the model runner uses the parent's row for the children)."""
        if session.params.n == 1 or session.group is not None or session.num_computed_tokens + n < session.num_tokens:
            return
        group = session.group = SequenceGroup(session.request_id, [session])
        at = self.running.index(session) + 1
        for i in range(1, session.params.n):
            child = session.fork(group.new_seq_id(), i, session.params.make_generator(session.generator.device, i))
            self.block_manager.fork(session.request_id, child.request_id)
            group.seqs.append(child)
            self.running.insert(at + i - 1, child)
            forks.append((session, child))

    def _beam_step(self, group: SequenceGroup) -> None:
        """One step of beam search (roseinfer/beam_search.py), then make the engine's sequences match it:
        a beam continued twice is forked, a beam nobody continues is freed, the rest grow by a token."""
        beams = group.seqs
        nxt = group.beam.step(torch.stack([b.pending_logprobs for b in beams]), [b.cumulative_logprob for b in beams],
                              [b.output_ids for b in beams])  # fmt: skip
        for b in beams:
            b.pending_logprobs = None
        at = self.running.index(beams[0]) if beams[0] in self.running else len(self.running)
        taken, new = set(), []
        for c in nxt:  # forks first, while every parent still has exactly its old tokens
            parent = beams[c.parent]
            if c.parent in taken:
                child = parent.fork(group.new_seq_id(), len(new), parent.generator)
                self.block_manager.fork(parent.request_id, child.request_id)
                new.append((child, c))
            else:
                taken.add(c.parent)
                new.append((parent, c))
        for i, b in enumerate(beams):
            if i not in taken:  # lost: its blocks go back (shared ones only lose a reference)
                self.finish(b)
        for b, c in new:
            if b in self.running:
                self.running.remove(b)
            b.output_ids.append(c.token)
            b.cumulative_logprob = c.cum_logprob
        group.seqs = [b for b, _ in new]
        self.running[at:at] = group.seqs  # the group's beams side by side, best first

    def _block_hashes(self, session: InferenceSession) -> list[bytes]:
        """The session's full-block hashes when prefix caching is on (else none: nothing is cached)."""
        bm = self.block_manager
        return session.update_block_hashes(bm.block_size) if bm.enable_prefix_caching else []

    def _preempt(self, session: InferenceSession) -> list[InferenceSession]:
        """Preempt by recompute: drop the K/V, keep the tokens, go back to the front of the queue. A request
        with several sequences goes back as a whole (stage 11). Returns the sequences preempted."""
        group = session.group.live if session.group is not None else [session]
        victims = [s for s in group if s in self.running]
        for s in reversed(victims):  # so that they stand in their order at the front of waiting
            self.block_manager.free(s.request_id)
            self.running.remove(s)
            s.num_computed_tokens = 0
            s.pending_logprobs = None  # a beam recomputes its distribution too
            self.waiting.appendleft(s)
            self._preempted.add(s.request_id)
        self.num_preemptions += 1
        return victims

    def finish(self, session: InferenceSession) -> None:
        """A request ended (or was aborted): free its blocks and its place in the batch."""
        self.block_manager.free(session.request_id)
        self._preempted.discard(session.request_id)
        if session in self.running:
            self.running.remove(session)
        elif session in self.waiting:
            self.waiting.remove(session)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
