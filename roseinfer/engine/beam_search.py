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

Only the 2W most likely tokens of each beam can be among the 2W best candidates of all beams, so a beam asks
the model runner for just those (`Request.num_candidates` = 2W) rather than a whole [V] distribution.

Everything about beams lives here; the core only offers generic operations, data in and data out:

    prepare(request)     a beam search's request is queued with a group of W places and 2W candidates: the
                         scheduler runs it as a group, the runner returns candidates instead of a sample
    step(output)         a group's candidates (`EngineCoreOutput.candidates`, reported once every running beam
                         has its own) in; out the `GroupUpdate` the scheduler carries out (a beam that several
                         candidates continue is forked and shares its blocks, one that none continues is
                         finished, each gets its token, best beam first) and, once the search is done, its
                         finished sequences (`EngineCoreOutput.completions`)
    forget(request_id)   an aborted or failed search

The numbers here are small tensors on the host; the scheduler sees none of them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from roseinfer.core.request import Request, RequestGroup
from roseinfer.core.sched.output import EngineCoreOutput, GroupUpdate
from roseinfer.sampling_params import BeamSearchParams

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


@dataclass
class Beam:
    seq_id: str  # the engine sequence that runs it
    token_ids: list[int]  # generated so far
    cum_logprob: float


@dataclass
class Search:
    state: BeamSearchState
    beams: list[Beam]  # running, best first (the group's order)
    child_ids: itertools.count = field(default_factory=lambda: itertools.count(1))  # "r#1", "r#2", ...


class BeamSearch:
    """The beam searches of the engine core, by request id (see the module docstring)."""

    def __init__(self):
        self.searches: dict[str, Search] = {}

    def prepare(self, request: Request) -> None:
        """A beam search's request runs as a group of beam_width sequences, each of which returns its 2·beam_width
        most likely next tokens instead of a sample (other requests are left as they are)."""
        p = request.sampling_params
        if isinstance(p, BeamSearchParams) and request.group is None:
            request.group = RequestGroup(request.request_id, p.beam_width, [request])
            request.num_candidates = 2 * p.beam_width

    def add(self, request: Request) -> None:
        """Start the search of a queued request (`prepare`d), if it is one."""
        p = request.sampling_params
        if isinstance(p, BeamSearchParams):
            end = min(request.num_tokens + p.max_tokens, request.max_model_len)
            state = BeamSearchState(p.beam_width, p.length_penalty, request.eos_token_ids, request.num_tokens, end)
            self.searches[request.request_id] = Search(state, [Beam(request.request_id, [], 0.0)])

    def forget(self, request_id: str) -> None:
        """An aborted or failed search (nothing if there is none)."""
        self.searches.pop(request_id, None)

    def step(self, output: EngineCoreOutput) -> tuple[GroupUpdate, EngineCoreOutput | None]:
        """One step of the search whose running beams all have their candidates."""
        gid, search = output.request_id, self.searches[output.request_id]
        beams, state = search.beams, search.state
        nxt = state.step([output.candidates[b.seq_id] for b in beams], [b.cum_logprob for b in beams],
                         [b.token_ids for b in beams])  # fmt: skip
        if state.done:
            del self.searches[gid]
            eos = state.eos_token_ids
            ranked = [(h.token_ids, h.cum_logprob, "stop" if h.token_ids and h.token_ids[-1] in eos else "length")
                      for h in state.finished]  # fmt: skip
            return GroupUpdate(gid, [], [], [], "stop"), EngineCoreOutput(gid, [], "stop", completions=ranked)
        taken, parents, new = set(), [], []
        for c in nxt:  # the first candidate of a beam continues it; any other one forks it
            parent = beams[c.parent]
            seq_id = f"{gid}#{next(search.child_ids)}" if c.parent in taken else parent.seq_id
            taken.add(c.parent)
            parents.append(parent.seq_id)
            new.append(Beam(seq_id, [*parent.token_ids, c.token], c.cum_logprob))
        search.beams = new
        return GroupUpdate(gid, [b.seq_id for b in new], parents, [[b.token_ids[-1]] for b in new]), None
