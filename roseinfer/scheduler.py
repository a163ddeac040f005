"""The continuous-batching scheduler: which requests run at each step, and with how many tokens.

(The stage-03 `OfflineScheduler`, which starts every request at once, is in
`roseinfer/offline_scheduler.py`; this module still exports it.)
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from roseinfer.block_manager import BlockSpaceManager
from roseinfer.checks import PREEMPTION_MODES, check_int
from roseinfer.offline_scheduler import KVCacheFullError, OfflineScheduler
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.sequence_group import SequenceGroup
from roseinfer.session import InferenceSession

if TYPE_CHECKING:
    from roseinfer.model_runner import ModelRunnerOutput

__all__ = ["KVCacheFullError", "OfflineScheduler", "Scheduler"]


class Scheduler:
    """Continuous batching (stage 06) under a token budget (stage 09), as in vLLM.

    Three queues. `waiting`: requests not running (new, or preempted by recompute), FCFS. `running`:
    requests that hold KV blocks. `swapped` (stage 12): preempted requests whose blocks are in the
    host pool. There are no prefill and decode phases: a request has `num_tokens` (prompt + generated)
    and `num_computed_tokens` (those whose K/V are in the cache), and each step hands out at most
    `max_num_batched_tokens` tokens of work:

      1. running requests first, oldest first: each gets what it still lacks, which is one token
         for a decode, or the rest of a prompt (a chunk of it if the budget is short). Its KV slots
         are booked; while the pool lacks the blocks, the youngest running request is preempted
         (below). A request with several sequences (stage 11) is booked and preempted as one;
      2. then, if this step preempted nobody, swapped requests come back, oldest first, while their
         blocks fit above the watermark;
      3. then, if nobody is left swapped, waiting requests, oldest first, while fewer than
         `max_num_seqs` run, tokens are left and the block manager can book the slots and still keep
         `watermark_blocks` free (else wait: nobody overtakes). With `enable_chunked_prefill` a
         prompt longer than the tokens left is cut: its first chunk now, the rest in later steps.
         Stage 10: with prefix caching, the longest run of a request's first full blocks that is
         already in the cache is shared, and it starts with num_computed_tokens past them;
      4. the result is a `SchedulerOutput`; after the model runner has run it,
         `update_from_output` advances every request and appends the sampled tokens.

        budget 64, running A B (decoding), C (prompt of 100, 48 computed), waiting D (prompt 30)
        step:  A 1 · B 1 · C 52 (its rest) · D 10 (a first chunk)     = 64 tokens, one forward

    Preemption (`preemption_mode`, vLLM's names): "recompute" frees the blocks and sends the request
    to the front of `waiting` with num_computed_tokens 0 (its tokens are kept; stage 07); "swap"
    (stage 12) copies its blocks to the host pool and parks it in `swapped` with everything computed
    kept. None: recompute for a request with one sequence, swap for one with several. When the host
    pool is full, a swap falls back to recompute.

    The watermark (stage 12) applies to admission only, and only while something else runs: with
    nothing running there is nobody to protect, and a request that fits the pool must not wait forever.

    Speculative decoding (stage 14): a decoding request may carry draft tokens (`spec_token_ids`, set by a
    proposer before the step). It is then booked for 1 + k tokens, its last token and the drafts, as far
    as the budget allows; when the blocks are short the drafts are dropped before anyone is preempted.
    After the step it advances by the drafts the target accepted, plus one, and gives the rejected
    drafts' slots back (`BlockSpaceManager.trim`).
    """

    def __init__(
        self,
        block_manager: BlockSpaceManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        preemption_mode: str | None = None,
    ):
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
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
        self.preemption_mode = preemption_mode
        self.waiting: deque[InferenceSession] = deque()
        self.running: list[InferenceSession] = []
        self.swapped: deque[InferenceSession] = deque()  # stage 12: oldest first, their blocks in the host pool
        self.num_preemptions = 0
        self.num_swapped_out = 0  # stage 12: requests swapped out / in since the start
        self.num_swapped_in = 0
        self._preempted: set[str] = set()  # ids that were preempted and have not run since
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache (stage 10)
        self.prefix_cache_hits = 0  # ... and found there
        self.spec_decode_num_drafts = 0  # stage 14: verifications (a request's drafts checked in one step)
        self.spec_decode_num_draft_tokens = 0  # ... the draft tokens they checked
        self.spec_decode_num_accepted_tokens = 0  # ... and kept
        self.spec_decode_num_accepted_tokens_per_pos: list[int] = []  # kept at draft position 0, 1, ...

    def add(self, session: InferenceSession) -> None:
        """Queue a request. One that could not fit the pool even alone (prompt + max_tokens) fails here."""
        self.check_fits(session)
        self.waiting.append(session)

    def check_fits(self, session: InferenceSession) -> None:
        """Raise ValueError if the request could never run: more sequences than `max_num_seqs`, or more KV
        blocks than the whole pool. Reads only fixed sizes (stage 13: a server checks before queueing)."""
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

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the class docstring)."""
        bm, budget = self.block_manager, self.max_num_batched_tokens
        out = SchedulerOutput([], {}, bm.block_tables)
        for unit in _units(self.running):  # oldest first; a unit is a request's running sequences
            if budget == 0:
                break  # out of tokens: the rest wait one step (they keep their blocks)
            if unit[0] not in self.running:
                break  # preempted below: it and everyone after it are gone
            plan = self._plan(unit, budget)
            while bm.blocks_needed([(s.request_id, n) for s, n in plan]) > bm.num_free_blocks:
                if any(s.spec_token_ids for s in unit):  # stage 14: drop the drafts before preempting anyone
                    for s in unit:
                        s.spec_token_ids = []
                    plan = self._plan(unit, budget)
                    continue
                self._preempt(self.running[-1], out)  # the youngest request gives its blocks back
                if unit[0] not in self.running:
                    break
            else:
                budget = self._book(plan, budget, out)
        while not out.preempted_req_ids and self.swapped:  # stage 12: swapped requests come back first
            unit = _units(self.swapped)[0]
            ids = [s.request_id for s in unit]
            headroom = len(ids) + bm.watermark_blocks if self.running else 0  # alone, it fits: add() checked
            if len(self.running) + len(unit) > self.max_num_seqs or not bm.can_swap_in(ids, headroom):
                break
            out.blocks_to_swap_in += bm.swap_in(ids)
            for _ in unit:
                self.running.append(self.swapped.popleft())
            out.scheduled_resumed_reqs += ids
            self.num_swapped_in += 1
            plan = self._plan(unit, budget)
            if bm.blocks_needed([(s.request_id, n) for s, n in plan]) <= bm.num_free_blocks:
                budget = self._book(plan, budget, out)  # else it computes next step
        while not out.preempted_req_ids and not self.swapped and self.waiting and budget > 0:
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
            keep = bm.watermark_blocks if self.running else 0  # stage 12: leave room for the running to grow
            if not bm.allocate_slots(session.request_id, n, hashes, hits, keep_free=keep):
                break  # LATER: FCFS, nobody overtakes the oldest waiting request
            session.num_computed_tokens = num_cached  # the shared blocks' K/V are there: start after them
            if session.request_id not in self._preempted:
                session.num_cached_tokens = num_cached
            self.prefix_cache_queries += session.num_tokens
            self.prefix_cache_hits += num_cached
            self.running.append(self.waiting.popleft())
            rid = session.request_id
            (out.scheduled_resumed_reqs if rid in self._preempted else out.scheduled_new_reqs).append(rid)
            self._preempted.discard(rid)
            budget = self._book([(session, n)], budget, out, booked=True)
        out.blocks_to_copy, bm.blocks_to_copy = bm.blocks_to_copy, []  # stage 11: copy-on-write, before the forward
        return out

    def _plan(self, unit: list[InferenceSession], budget: int) -> list[tuple[InferenceSession, int]]:
        """The tokens each sequence of a unit computes this step, within the budget: what it still lacks
        (0 for a beam that waits for its siblings' log-probabilities: stage 11), plus its draft tokens
        (stage 14: as many as the budget leaves room for)."""
        plan = []
        for s in unit:
            n = min(s.num_tokens - s.num_computed_tokens, budget)
            if n == 1 and s.spec_token_ids:
                n += min(len(s.spec_token_ids), budget - 1)
            if n:
                plan.append((s, n))
                budget -= n
        return plan

    def _book(self, plan, budget: int, out: SchedulerOutput, booked: bool = False) -> int:
        """Book the slots of a plan whose blocks are known to be free, schedule it, return the budget left."""
        for s, n in plan:
            if not booked and not self.block_manager.allocate_slots(s.request_id, n, self._block_hashes(s)):
                raise AssertionError(f"blocks_needed promised room for {s.request_id!r}")
            out.scheduled.append(s)
            out.num_scheduled_tokens[s.request_id] = n
            drafts = n - (s.num_tokens - s.num_computed_tokens)  # stage 14: scheduled beyond its own tokens
            if drafts > 0:
                out.scheduled_spec_decode_tokens[s.request_id] = s.spec_token_ids[:drafts]
            budget -= n
            self._fork_if_sampling_n(s, n, out.forks)
        return budget

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[InferenceSession]:
        """After the forward: count the computed tokens, append the sampled ones, and let beam searches whose
        beams all have their log-probabilities take a step. Returns the sequences that got a token (some
        may now be finished; the caller retires those with `finish`), and the first beam of a finished search."""
        for session in sched.scheduled:
            session.spec_token_ids, session.spec_draft_probs = [], None  # used (or not) this step: gone
            drafts = len(sched.scheduled_spec_decode_tokens.get(session.request_id, ()))
            session.num_computed_tokens += sched.num_scheduled_tokens[session.request_id] - drafts
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
            elif rid in out.spec_sampled:  # stage 14: the accepted drafts, then the target's token
                self._accept(session, sched.scheduled_spec_decode_tokens[rid], out.spec_sampled[rid])
                produced.append(session)
        for group in searches.values():
            if all(s.pending_logprobs is not None for s in group.seqs):
                first = group.seqs[0]
                self._beam_step(group)
                if group.beam.done:
                    produced.append(first)  # its group tells the caller the search is over
        return produced

    def _accept(self, session: InferenceSession, drafts: list[int], tokens: list[int]) -> None:
        """Stage 14: append a verified run of tokens one by one, so that EOS, a stop string or max_tokens inside
        it ends the request exactly where plain decoding would have; the K/V of every accepted draft is already
        in the cache, the rejected drafts' slots go back to the block manager."""
        accepted = len(tokens) - 1
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += len(drafts)
        self.spec_decode_num_accepted_tokens += accepted
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        per_pos += [0] * (len(drafts) - len(per_pos))
        for i in range(accepted):
            per_pos[i] += 1
        session.num_computed_tokens += accepted  # the last token's K/V came with this step, and the drafts' kept
        delta = ""
        for token in tokens:
            session.append_token(token)
            delta += session.last_delta
            if session.finished:
                break
        session.last_delta = delta  # everything that became final this step
        if not session.finished:
            self.block_manager.trim(session.request_id, session.num_computed_tokens)

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

    def _preempt(self, session: InferenceSession, out: SchedulerOutput) -> None:
        """Preempt a request: all of its running sequences (stage 11), by swapping them out when the mode
        says so and the host pool has room (stage 12), else by recompute."""
        group = session.group.live if session.group is not None else [session]
        victims = [s for s in group if s in self.running]
        ids = [s.request_id for s in victims]
        mode = self.preemption_mode or ("swap" if _max_num_seqs(session) > 1 else "recompute")
        swap = mode == "swap" and self.block_manager.can_swap_out(ids)
        if swap:  # K/V to the host pool; everything computed, a beam's log-probabilities too, is kept
            out.blocks_to_swap_out += self.block_manager.swap_out(ids)
            self.num_swapped_out += 1
        for s in reversed(victims):  # so that they stand in their order at the front of their queue
            self.running.remove(s)
            s.spec_token_ids, s.spec_draft_probs = [], None  # stage 14: guesses for a step that will not come
            if swap:
                self.swapped.appendleft(s)
                continue
            self.block_manager.free(s.request_id)  # recompute: drop the K/V, keep the tokens
            s.num_computed_tokens = 0
            s.pending_logprobs = None  # a beam recomputes its distribution too
            self.waiting.appendleft(s)
            self._preempted.add(s.request_id)
        out.preempted_req_ids += ids
        self.num_preemptions += 1

    def finish(self, session: InferenceSession) -> None:
        """A request ended (or was aborted): free its blocks (stage 12: on the device or in the host pool) and
        its place in the batch."""
        self.block_manager.free(session.request_id)
        self._preempted.discard(session.request_id)
        for queue in (self.running, self.waiting, self.swapped):
            if session in queue:
                queue.remove(session)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)


def _units(queue) -> list[list[InferenceSession]]:
    """A queue's sequences by request: the sequences of a group stand side by side (stage 11), and are
    booked, preempted and swapped together (stage 12)."""
    units: list[list[InferenceSession]] = []
    for s in queue:
        if units and s.group is not None and units[-1][0].group is s.group:
            units[-1].append(s)
        else:
            units.append([s])
    return units


def _max_num_seqs(session: InferenceSession) -> int:
    """The sequences a request runs at most (vLLM's get_max_num_running_seqs): n, or the beam width."""
    group = session.group
    return group.beam.beam_width if group is not None and group.beam is not None else session.params.n
