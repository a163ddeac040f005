"""Beam search over the engine's sequences (stage 11), step for step what Hugging Face `generate` does with
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

The engine side of a step: a candidate's beam may be chosen by several children (fork its blocks, copy
on write later), or by none (free its blocks). The numbers here are plain tensors on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    eos_token_id: int | None  # None: EOS is an ordinary token (ignore_eos)
    prompt_len: int
    max_len: int  # prompt + max_tokens (or the model's context, if shorter)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    _can_improve: bool = True  # HF's is_early_stop_heuristic_unsatisfied

    def step(self, logprobs: torch.Tensor, cum_logprobs: list[float], generated: list[list[int]]) -> list[Candidate]:
        """logprobs [R, V] of the R running beams (best first), their cumulative log-probabilities and
        generated tokens so far. Returns the next running beams, best first (empty when the search ends)."""
        W, (R, V) = self.beam_width, logprobs.shape
        cur_len = self.prompt_len + len(generated[0])  # every running beam has the same length
        scores = logprobs.float() + torch.tensor(cum_logprobs)[:, None]  # [R, V]
        if R < W:  # HF keeps W rows; missing beams score -1e9 and only matter if the vocabulary is tiny
            scores = torch.cat([scores, torch.full((W - R, V), NEG) + logprobs[:1].float()])
        top_scores, top_idx = torch.topk(scores.reshape(-1), k=2 * W)  # [2W] over beams x tokens, beam-major
        cands = [Candidate(int(i) // V, int(i) % V, float(s)) for s, i in zip(top_scores, top_idx, strict=True)]
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
        return (self.eos_token_id is not None and c.token == self.eos_token_id) or cur_len + 1 >= self.max_len
