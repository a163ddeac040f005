"""Beam search over the engine's sequences, step for step what Hugging Face `generate` does with
`num_beams=W, do_sample=False, early_stopping=True, length_penalty=L`.

State of one search (one prompt):

    running    up to W beams (engine sequences), best first, each with its cumulative log-probability
    finished   W slots of finished hypotheses (token ids, cumulative log-probability, score), best first;
               an empty slot has score -1e9
    score      cum_logprob / generated_length ** L        (L > 0 favours longer hypotheses)

One step, once every running beam's next-token log-probabilities are computed:

    1. every beam × every token: cum_logprob(beam) + logprob(token); keep the top 2W candidates
       (2W, so that W of them still run even if W end with EOS)
    2. a candidate hits a stop if its token is EOS or it reaches max_tokens
    3. the W best candidates that do not stop are the next running beams
    4. the candidates among the top W that stop compete with the finished slots for W places
    5. the search ends when all W slots are taken (early stopping), or nothing can run any more

Only the 2W most likely tokens of each beam can be among the 2W best candidates of all beams, so the model
runner sends just those (token ids and log-probabilities) rather than a whole [V] distribution per beam.

The engine side of a step (`BeamSearchCoordinator`, in the engine core): a candidate's beam may be chosen
by several children (the scheduler forks its blocks, to be copied on write later), or by none (the
scheduler frees it). The numbers here are small tensors on the host; the scheduler sees none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roseinfer.core.sched.output import EngineCoreOutput

NEG = -1.0e9  # Hugging Face's "impossible" score


@dataclass
class Candidate:
    parent: int  # index of the running beam it extends
    token: int
    cum_logprob: float


@dataclass
class Hypothesis:
    score: float  # cum_logprob / generated_length ** length_penalty
    token_ids: list[int]  # generated tokens, the last one an EOS if it ended there
    cum_logprob: float


@dataclass
class BeamSearchState:
    beam_width: int
    length_penalty: float
    eos_token_ids: frozenset[int]  # empty: EOS is an ordinary token (ignore_eos)
    prompt_len: int
    max_len: int  # prompt + max_tokens (or the model's context, if shorter)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    _can_improve: bool = True  # HF's is_early_stop_heuristic_unsatisfied

    def step(self, top: list[tuple[list[int], list[float]]], cum_logprobs: list[float],
             generated: list[list[int]]) -> list[Candidate]:  # fmt: skip
        """top: each of the R running beams' (best first) most likely next tokens and their log-probabilities,
        best first; their cumulative log-probabilities and generated tokens so far. Returns the next running
        beams, best first (empty when the search ends)."""
        W, R = self.beam_width, len(top)
        K = min(len(ids) for ids, _ in top)
        ids = torch.tensor([t[:K] for t, _ in top])  # [R, K]
        logprobs = torch.tensor([lp[:K] for _, lp in top], dtype=torch.float32)  # [R, K]
        cur_len = self.prompt_len + len(generated[0])  # every running beam has the same length
        scores = logprobs + torch.tensor(cum_logprobs)[:, None]  # [R, K]
        if R < W:  # HF keeps W rows; missing beams score -1e9 and only matter if the vocabulary is tiny
            scores = torch.cat([scores, torch.full((W - R, K), NEG) + logprobs[:1]])
            ids = torch.cat([ids, ids[:1].expand(W - R, K)])
        top_scores, top_idx = torch.topk(scores.reshape(-1), k=2 * W)  # [2W] over beams x tokens, beam-major
        flat_ids = ids.reshape(-1)
        cands = [Candidate(int(i) // K, int(flat_ids[i]), float(s)) for s, i in zip(top_scores, top_idx, strict=True)]
        hits = [self._stops(c, cur_len) for c in cands]

        # 3. the next running beams: the best W that do not stop
        running_scores = top_scores + torch.tensor(hits, dtype=torch.float32) * NEG
        keep = torch.topk(running_scores, k=W).indices.tolist()
        nxt = [Candidate(cands[i].parent, cands[i].token, float(running_scores[i])) for i in keep]

        # 4. finished: only the top W candidates may finish, and only while the slots can still improve
        full = len(self.finished) == W
        may_finish = torch.tensor([i < W and hit and not full and self._can_improve for i, hit in enumerate(hits)])
        penalized = top_scores / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)  # float32, as HF
        penalized = torch.where(may_finish, penalized, penalized + NEG)  # HF adds -1e9 rather than dropping
        slots = self.finished + [None] * (W - len(self.finished))  # W places, the empty ones at -1e9
        merged = slots + [Hypothesis(float(p), [*generated[c.parent], c.token], c.cum_logprob)
                          for c, p in zip(cands, penalized, strict=True)]  # fmt: skip
        merged_scores = torch.cat([torch.tensor([h.score if h else NEG for h in slots]), penalized])
        order = torch.topk(merged_scores, k=W).indices.tolist()
        self.finished = [merged[i] for i in order if merged_scores[i] > NEG / 2]

        # 5. stop?
        cur_len += 1
        if len(self.finished) == W:  # every slot taken: can the best running beam still beat the worst?
            best_running = float(running_scores[keep[0]]) / ((cur_len - self.prompt_len) ** self.length_penalty)
            self._can_improve = self._can_improve and best_running > min(h.score for h in self.finished)
        open_beam = len(self.finished) < W  # early_stopping=True: done once W hypotheses are finished
        self.done = not (self._can_improve and open_beam and not all(hits))
        return [] if self.done else nxt

    def _stops(self, c: Candidate, cur_len: int) -> bool:
        return c.token in self.eos_token_ids or cur_len + 1 >= self.max_len


class BeamSearchCoordinator:
    """Runs the beam searches of the engine core over the scheduler's sequences.

    After each step it keeps every beam's top tokens (`ModelRunnerOutput.beam_logprobs`); once all running beams
    of a search have theirs (and have computed their last token), the search steps: forks, frees and appends,
    through the scheduler. A finished search reports its best sequences once."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.searches: dict[str, BeamSearchState] = {}  # request id -> its search
        self.pending: dict[str, tuple[list[int], list[float]]] = {}  # beam id -> its top tokens, until the search steps

    def add(self, request) -> None:
        p = request.sampling_params
        end = min(request.num_tokens + p.max_tokens, request.max_model_len)
        self.searches[request.request_id] = BeamSearchState(p.beam_width, p.length_penalty, request.eos_token_ids,
                                                            request.num_tokens, end)  # fmt: skip

    def forget(self, group) -> None:
        """An aborted search."""
        self.searches.pop(group.group_id, None)
        for b in group.seqs:
            self.pending.pop(b.request_id, None)

    def on_step(self, beam_logprobs: dict[str, tuple[list[int], list[float]]]) -> list[EngineCoreOutput]:
        """Keep the step's beam distributions; step every search whose beams all have theirs."""
        if not beam_logprobs:
            return []
        self.pending.update(beam_logprobs)
        outputs, sched = [], self.scheduler
        for group_id in {sched.requests[rid].group.group_id for rid in beam_logprobs if rid in sched.requests}:
            group = sched.groups[group_id]
            beams = group.seqs
            if all(b.request_id in self.pending and b.num_computed_tokens == b.num_tokens for b in beams):
                out = self._step(group)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _step(self, group) -> EngineCoreOutput | None:
        sched, search = self.scheduler, self.searches[group.group_id]
        beams = group.seqs
        nxt = search.step([self.pending.pop(b.request_id) for b in beams], [b.cumulative_logprob for b in beams],
                          [b.output_token_ids for b in beams])  # fmt: skip
        if search.done:
            sched.finish_requests([b.request_id for b in beams], "stop")
            del self.searches[group.group_id]
            eos = search.eos_token_ids
            ranked = [(h.token_ids, h.cum_logprob, "stop" if h.token_ids and h.token_ids[-1] in eos else "length")
                      for h in search.finished]  # fmt: skip
            return EngineCoreOutput(group.group_id, [], "stop", beams=ranked)
        taken, new = set(), []
        for c in nxt:  # forks first, while every parent still has exactly its old tokens
            parent = beams[c.parent]
            if c.parent in taken:
                new.append((sched.fork_request(parent), c))
            else:
                taken.add(c.parent)
                new.append((parent, c))
        lost = [b.request_id for i, b in enumerate(beams) if i not in taken]
        group.seqs = [b for b, _ in new]
        sched.finish_requests(lost, "abort")  # nobody continues it: its blocks go back (shared ones lose a reference)
        for b, c in new:
            sched.append_token_ids(b, [c.token])
            b.cumulative_logprob = c.cum_logprob
        sched.reorder_group(group)  # the group's beams side by side, best first
        return None
