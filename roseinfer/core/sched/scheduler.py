"""The scheduler: which requests run at each step, and with how many tokens. Ids and counters only.

Three queues, as in vLLM: `waiting` (new, or preempted by recompute; FCFS), `running` (they hold KV
blocks), `swapped` (preempted, their blocks in the host pool). There are no prefill and decode phases: a
request has `num_tokens` (prompt + generated) and `num_computed_tokens` (those whose K/V are in the
cache), and each step hands out at most `max_num_batched_tokens` tokens of work:

  1. running requests first, oldest first: each gets what it still lacks, one token for a decode (plus its
     drafts, when it speculates), or the rest of a prompt (a chunk of it if the budget is short). Its KV
     slots are booked; while the pool lacks the blocks, the youngest running request is preempted. The
     sequences of one request (n > 1, a group such as a beam search) are booked and preempted as one;
  2. then, if this step preempted nobody, swapped requests come back, oldest first, while their blocks fit
     above the watermark;
  3. then, if nobody is left swapped, waiting requests, oldest first (passing over any whose grammar is still
     compiling: roseinfer/structured_output/), while fewer than `max_num_seqs` run,
     tokens are left and their slots can be booked with `watermark_blocks` still free (else wait: nobody
     overtakes). A prompt longer than the tokens left is cut, with chunked prefill; the longest run of its
     first full blocks that the prefix cache holds is shared, and it starts past them;
  4. the result is a `SchedulerOutput` (roseinfer/core/sched/output.py), numbered by its `step_id`: data for
     the model runner, with the block copies and table changes that the KV cache manager's calls returned
     (`KVCacheBlocks`). After the runner has run it, `update_from_output` appends the tokens it sampled and
     checks the stops that need no text (EOS, stop token ids, max_tokens, the context).

        budget 64, running A B (decoding), C (prompt of 100, 48 computed), waiting D (prompt 30)
        step:  A 1 · B 1 · C 52 (its rest) · D 10 (a first chunk)     = 64 tokens, one forward

Preemption (`preemption_mode`, vLLM's names): "recompute" frees the blocks and sends the request to the
front of `waiting` with num_computed_tokens 0 (its tokens are kept); "swap" copies its blocks to the host
pool and parks it in `swapped`. None: recompute one sequence, swap several. A full host pool falls back to
recompute. The watermark applies to admission only, and only while something else runs.

Speculative decoding: a decoding request with drafts (proposed by the runner after the step before) is
booked for 1 + k tokens, as far as the budget allows; short of blocks, the drafts go before anyone is
preempted. A draft model writes K/V for its guesses: decodes book `num_lookahead_tokens` slots ahead.
"""

from __future__ import annotations

from collections import deque

from roseinfer.config import SchedulerConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.request import Request, RequestGroup
from roseinfer.core.sched import groups, output
from roseinfer.core.sched.groups import max_num_running_seqs, num_sequences_admitted, sequences_at, tokens_per_sequence
from roseinfer.core.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SpecDecodingStats
from roseinfer.core.sched.runner_view import RunnerView


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.lookahead = config.num_lookahead_tokens
        self.prefix_caching = kv_cache_manager.enable_prefix_caching
        self.async_scheduling = config.async_scheduling
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by id
        self.groups: dict[str, RequestGroup] = {}  # requests with several sequences, by the caller's id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # oldest first, their blocks in the host pool
        self.num_preemptions = 0
        self.num_swapped_out = 0  # requests swapped out / in since the start
        self.num_swapped_in = 0
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_cache_hits = 0  # ... and found there
        self.spec_decoding_stats = SpecDecodingStats()
        self.runner_view = RunnerView(kv_cache_manager)  # what the runner holds: each step sends only changes
        self.next_step_id = 0
        self._in_flight: dict[int, dict[str, Request]] = {}  # async scheduling: step id -> the requests it scheduled

    # ---- requests in and out ---------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (with its group, if it runs as several sequences from the start). One that could not
        fit the pool even alone (prompt + max_tokens) fails here."""
        self.check_fits(request)
        if request.group is not None:
            self.groups[request.request_id] = request.group
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never run: more sequences than `max_num_seqs`, or more KV
        blocks than the whole pool. Reads only fixed sizes (a server checks before queueing)."""
        kv, seqs = self.kv_cache_manager, max_num_running_seqs(request)
        if seqs > self.max_num_seqs:
            raise ValueError(
                f"request asks for {seqs} sequences (n / beam_width) but max_num_seqs is {self.max_num_seqs}"
            )
        n = min(request.num_tokens + request.max_tokens, request.max_model_len)
        # n sequences share the prompt's blocks; each needs its own for the rest (+1 copied on write)
        need = kv.blocks_for(n) + (seqs - 1) * (kv.blocks_for(n - request.num_tokens) + 1)
        if need > kv.num_blocks:
            p = request.num_prompt_tokens
            raise ValueError(
                f"request needs up to {need} KV blocks of {kv.block_size} tokens "
                f"({p} prompt + {n - p} new tokens, {seqs} sequence(s)), "
                f"but the whole KV cache pool has {kv.num_blocks}"
            )

    def finish_requests(self, request_ids, reason: str) -> None:
        """End sequences now (an abort, a stop string, one a `GroupUpdate` drops): free their blocks and places."""
        gone = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.finish_reason is None:
                req.finish_reason = reason
            gone.append(req)
            self.kv_cache_manager.free(rid)
            self.runner_view.release(rid)
        for req in gone:
            if req.group is not None and not req.group.live:
                self.groups.pop(req.group.group_id, None)
        if gone:
            ids = {r.request_id for r in gone}
            self.running[:] = [r for r in self.running if r.request_id not in ids]
            for queue in (self.waiting, self.swapped):
                if any(r.request_id in ids for r in queue):
                    kept = [r for r in queue if r.request_id not in ids]
                    queue.clear()
                    queue.extend(kept)

    def sequence_ids(self, request_id: str) -> list[str]:
        """The unfinished sequences of the caller's request `request_id` (itself, or its group's)."""
        group = self.groups.get(request_id)
        if group is not None:
            return [s.request_id for s in group.seqs if not s.finished]
        return [request_id] if request_id in self.requests else []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring)."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(step_id=self.next_step_id)
        self.next_step_id += 1
        self.runner_view.start_step(out)
        if self.async_scheduling:  # its outputs arrive after the next schedule: a finished id may be reused by then
            self._in_flight[out.step_id] = {}
        running, i = self.running, 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.group is not None and len(req.group.seqs) > 1:
                i, budget = self._schedule_group(i, budget, out)
                continue
            n = len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens
            if n == 0 or (req.num_output_placeholders and req.last_token_in_flight):  # waits for its token; or done
                i += 1
                continue
            n = min(n, budget)
            if req.spec_token_ids and n == 1:
                n += min(len(req.spec_token_ids), budget - 1)
            while not self._allocate_slots(req, n, out):
                if n > 1 and req.spec_token_ids:  # drop the drafts before preempting anyone
                    req.spec_token_ids, n = [], 1
                    continue
                self._preempt(running[-1], out)  # the youngest request gives its blocks back
                if i >= len(running):
                    break  # that was this request itself
            if i >= len(running):
                break  # preempted itself: everyone after it is gone too
            budget -= n
            i += 1 + self._schedule_tokens(req, n, out)  # (past the sequences it forked into: they sampled now)
        self._admit(budget, out)
        return out

    def _allocate_slots(
        self, req: Request, n: int, out: SchedulerOutput, block_hashes=(), cached_blocks=(), keep_free: int = 0
    ) -> bool:
        """Allocate a request's slots for `n` tokens, with the draft model's lookahead when the pool has room.
        What the KV cache manager did goes into this step: its copy-on-write pairs, and its table change to the
        runner view (the runner learns it when the request is scheduled)."""
        kv, rid = self.kv_cache_manager, req.request_id
        if self.prefix_caching and not block_hashes:
            block_hashes = req.block_hashes
            if (req.num_computed_tokens + n) // kv.block_size > len(block_hashes):
                block_hashes = req.update_block_hashes(kv.block_size)
        blocks = None
        if self.lookahead and req.speculates:
            blocks = kv.allocate_slots(rid, n, block_hashes, cached_blocks, keep_free, self.lookahead)
        if blocks is None:
            blocks = kv.allocate_slots(rid, n, block_hashes, cached_blocks, keep_free)
            if blocks is None:
                return False
        if blocks.copies:
            out.blocks_to_copy += blocks.copies  # copy-on-write, before the forward
        self.runner_view.record_blocks(rid, blocks)
        return True

    def _schedule_group(self, i: int, budget: int, out: SchedulerOutput) -> tuple[int, int]:
        """The running sequences of one request (side by side in `running` from index i): allocated together, or
        the youngest running request is preempted until they fit (or they are). Returns (next index, budget)."""
        running, kv = self.running, self.kv_cache_manager
        seqs = sequences_at(running, i)
        work = tokens_per_sequence(seqs, budget)
        while kv.blocks_needed([(s.request_id, n) for s, n in work]) > kv.num_free_blocks:
            self._preempt(running[-1], out)
            if seqs[0] not in running:
                return len(running), 0  # preempted itself: stop here
        return i + len(seqs), self._schedule_all(work, budget, out)

    def _schedule_all(self, work: list[tuple[Request, int]], budget: int, out: SchedulerOutput) -> int:
        """Schedule sequences that `blocks_needed` said fit, each for its tokens. Returns the budget left."""
        for s, n in work:
            if not self._allocate_slots(s, n, out):
                raise AssertionError(f"blocks_needed promised room for {s.request_id!r}")
            budget -= n
            self._schedule_tokens(s, n, out)
        return budget

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        """Swapped requests come back first, then waiting ones, while nothing was preempted in this step."""
        kv = self.kv_cache_manager
        while not out.preempted_req_ids and self.swapped:
            seqs = sequences_at(self.swapped, 0)
            ids = [s.request_id for s in seqs]
            headroom = len(ids) + kv.watermark_blocks if self.running else 0  # alone, it fits: add_request checked
            if len(self.running) + len(seqs) > self.max_num_seqs or not kv.can_swap_in(ids, headroom):
                break
            out.blocks_to_swap_in += kv.swap_in(ids)
            for _ in seqs:
                self.running.append(self.swapped.popleft())
            self.num_swapped_in += 1
            work = tokens_per_sequence(seqs, budget)
            if work and kv.blocks_needed([(s.request_id, n) for s, n in work]) <= kv.num_free_blocks:
                budget = self._schedule_all(work, budget, out)  # else they compute next step
        while not out.preempted_req_ids and not self.swapped and budget > 0:
            req = next((r for r in self.waiting if r.is_ready), None)  # (one whose grammar compiles lets others by)
            if req is None or len(self.running) + num_sequences_admitted(req) > self.max_num_seqs:
                break  # nobody ready; or a request with n sequences needs n places
            hashes = req.update_block_hashes(kv.block_size) if kv.enable_prefix_caching else []
            cached = []  # a cached prefix is shared; not with prompt log-probabilities (they need every position)
            if req.sampling_params.prompt_logprobs is None:
                cached = kv.find_cached_blocks(hashes, req.num_tokens)
            num_cached = len(cached) * kv.block_size
            n = req.num_tokens - num_cached
            if n > budget and not self.config.enable_chunked_prefill:
                break  # the whole prompt does not fit this step's budget: wait for a step with room
            n = min(n, budget)
            keep_free = kv.watermark_blocks if self.running else 0  # leave room for the running to grow
            if not self._allocate_slots(req, n, out, hashes or (), cached, keep_free):
                break  # LATER: FCFS, nobody overtakes the oldest waiting request
            req.num_computed_tokens = num_cached  # the shared blocks' K/V are there: start after them
            view = self.runner_view
            if req.request_id not in view.seen and req.request_id not in view.resumed:
                req.num_cached_tokens = num_cached  # first admission (a resumed request hits its own blocks)
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
            self.waiting.remove(req)
            self.running.append(req)
            budget -= n
            self._schedule_tokens(req, n, out)

    def _schedule_tokens(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """Put `n` tokens of a request whose slots are allocated into this step. Returns how many sequences it
        forked into."""
        self.runner_view.add_scheduled(req, n, out)
        if self.async_scheduling:
            self._in_flight[out.step_id][req.request_id] = req
        if n > 1 and req.spec_token_ids:
            drafts = n - (req.num_tokens - req.num_computed_tokens)  # scheduled beyond its own tokens
            if drafts > 0:
                out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:drafts]
        req.num_computed_tokens += n
        if self.async_scheduling and req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += not req.num_candidates  # it samples now: its token is in flight till then
        if req.sampling_params.n > 1 and req.group is None and req.num_computed_tokens >= req.num_tokens:
            return self._fork_parallel_samples(req, out)
        return 0

    def _fork_parallel_samples(self, req: Request, out: SchedulerOutput) -> int:
        """A request with n > 1 completions runs its prompt once; in the step that computes its last prompt
        token it is forked into n sequences that share its blocks, and each samples its own token from the
        same logits (the runner uses the parent's row for the children)."""
        group = req.group = self.groups[req.request_id] = RequestGroup(req.request_id, req.sampling_params.n, [req])
        at = self.running.index(req) + 1
        for i in range(1, req.sampling_params.n):
            child = req.fork(group.new_seq_id(), i)
            self.kv_cache_manager.fork(req.request_id, child.request_id)
            group.seqs.append(child)
            self.requests[child.request_id] = child
            self.running.insert(at + i - 1, child)
            out.forks.append(self.runner_view.fork(req, child, sample_now=True))
            if self.async_scheduling:
                self._in_flight[out.step_id][child.request_id] = child
        return req.sampling_params.n - 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """After the forward: append each sampled token and check its stops; keep what speculation accepted and
        give back the slots of what it rejected; free the requests that finished. Returns what the engine's
        output processor needs, one entry per sequence that got tokens."""
        outputs, finished, out = [], [], model_runner_output
        spec, proposed = scheduler_output.scheduled_spec_decode_tokens, out.spec_token_ids
        scheduled = self._in_flight.pop(scheduler_output.step_id, None)  # async: what that step scheduled
        logprobs, prompt_logprobs = out.logprobs, out.prompt_logprobs
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            req = self.requests.get(rid)
            if req is None or not tokens:  # gone meanwhile, or its token is chosen outside (its candidates: below)
                continue
            if scheduled is not None and scheduled.get(rid) is not req:
                continue  # async: that request ended meanwhile and a new one took its id
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            drafts = spec.get(rid)
            if drafts is not None:
                self._count_accepted(req, len(drafts), len(tokens) - 1)
            if len(tokens) == 1:
                stopped = req.append_token(tokens[0])
            else:
                for n, t in enumerate(tokens, 1):  # a verified run token by token: a stop inside it ends it there
                    if stopped := req.append_token(t):
                        tokens = tokens[:n]
                        break
            lp = logprobs.get(rid) if logprobs else None
            if lp is not None:
                req.cumulative_logprob += sum(row[0] for row in lp.logprobs[: len(tokens)])
            group = req.group
            outputs.append(EngineCoreOutput(rid, tokens, req.finish_reason,
                                            group.group_id if group is not None else None, req.index,
                                            req.cumulative_logprob if lp is not None else None,
                                            req.num_cached_tokens, None, lp,
                                            prompt_logprobs.get(rid) if prompt_logprobs else None))  # fmt: skip
            if stopped:
                finished.append(rid)
            elif proposed or req.spec_token_ids:  # drafts for the next step; the ones just verified are used
                req.spec_token_ids = proposed.get(rid, [])
        if finished:
            self.finish_requests(finished, "stop")
        if out.candidates:  # groups whose sequences all have their candidates report them
            outputs += groups.ready_candidates(self.requests, out.candidates)
        return outputs

    def _count_accepted(self, req: Request, num_drafts: int, accepted: int) -> None:
        """Speculation: the target kept `accepted` of the request's drafts; the K/V of the rest are not its tokens
        (their blocks go back, and the runner learns the shorter table at the request's next step)."""
        self.spec_decoding_stats.observe(num_drafts, accepted)
        req.num_computed_tokens -= num_drafts - accepted
        blocks = self.kv_cache_manager.trim(req.request_id, req.num_computed_tokens, self.lookahead)
        self.runner_view.record_blocks(req.request_id, blocks)

    # ---- a group's next sequences, chosen outside the runner --------------------------------------
    def update_group(self, update: output.GroupUpdate) -> None:
        """Carry out a `GroupUpdate`: forks first, while every parent has its old tokens (a child shares its parent's
        blocks and stands right after it; the runner copies the parent's row), then the ones nobody continues finish,
        each gets its tokens (the runner learns them next step), and they stand side by side in the update's order."""
        group = self.groups[update.group_id]
        old = {s.request_id: s for s in group.seqs}
        seqs, index = [], len(group.seqs)
        for sid, pid in zip(update.seq_ids, update.parent_ids, strict=True):
            if sid == pid:
                seqs.append(old[pid])
                continue
            parent, child = old[pid], old[pid].fork(sid, index)
            seqs.append(child)
            self.kv_cache_manager.fork(pid, sid)
            self.requests[sid] = child
            self.runner_view.forks.append(self.runner_view.fork(parent, child, sample_now=False))
            self.running.insert(self.running.index(parent) + 1, child)
        group.seqs = seqs
        self.finish_requests([rid for rid in old if rid not in update.seq_ids], update.finish_reason)
        for s, tokens in zip(seqs, update.token_ids, strict=True):
            s.all_token_ids += tokens
            s.candidates = None
            self.runner_view.new_token_ids.setdefault(s.request_id, []).extend(tokens)
        groups.side_by_side(self.running, seqs)

    # ---- preemption --------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt a request: all of its running sequences, by swapping them out when the mode says so and
        the host pool has room, else by recompute."""
        group = req.group.live if req.group is not None else [req]
        victims = [s for s in group if s in self.running]
        ids = [s.request_id for s in victims]
        kv = self.kv_cache_manager
        mode = self.config.preemption_mode or ("swap" if max_num_running_seqs(req) > 1 else "recompute")
        swap = mode == "swap" and kv.can_swap_out(ids)
        if swap:  # K/V to the host pool; everything computed is kept
            out.blocks_to_swap_out += kv.swap_out(ids)
            self.num_swapped_out += 1
        members = set(victims)
        self.running[:] = [r for r in self.running if r not in members]
        for s in reversed(victims):  # so that they stand in their order at the front of their queue
            s.spec_token_ids = []  # guesses for a step that will not come
            self.runner_view.preempt(s.request_id)  # its next step sends a whole table
            if swap:
                self.swapped.appendleft(s)
                continue
            kv.free(s.request_id)  # recompute: drop the K/V, keep the tokens
            s.num_computed_tokens = 0
            self.waiting.appendleft(s)
        out.preempted_req_ids += ids
        self.num_preemptions += 1
