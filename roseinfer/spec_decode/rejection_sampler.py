"""Verification: which draft tokens to keep, so that nothing about the output changes.

The target has scored every position: p_i is its next-token distribution after the last token and
drafts d_1 .. d_i (i = 0 .. k, k + 1 rows of logits). Walk the drafts in order:

    greedy     keep d_i while d_i == argmax p_(i-1); at the first miss emit argmax p_(i-1) instead
               (the target's own token); if all k pass, emit argmax p_k as a bonus.
               The output IS the target's greedy output, token for token.

    sampling   keep d_i with probability min(1, p(d_i) / q(d_i)), q being the distribution d_i was drawn
               from (the draft model's, or one-hot for an n-gram guess); at the first rejection emit a
               token drawn from max(0, p - q) renormalised; if all k pass, a bonus drawn from p_k.

Why sampling loses nothing (one position; the rest follow by induction): a token x comes out either
accepted, with probability q(x) · min(1, p(x)/q(x)) = min(q(x), p(x)), or as the replacement after a
rejection, which happens with probability 1 - Σ_y min(q(y), p(y)) = Σ_y max(0, p(y) - q(y)) =: Z and then
yields x with probability max(0, p(x) - q(x)) / Z. Together: min(q, p) + max(0, p - q) = p(x). Exactly
the target's distribution, whatever q is; a better q only means fewer rejections.

Each request draws its uniform numbers from its own generator: a seeded request is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roseinfer.sampling import SamplingParams, draw, filtered_probs


def rejection_sample(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[list[int]]:
    """The tokens each request gets this step: its accepted drafts, then one token of the target's.

    logits [sum(k_b + 1), V]: request b's k_b + 1 rows, one request after another; draft_token_ids[b]: its
    k_b drafts; draft_probs[b]: q of each draft [k_b, V], or None for one-hot guesses (n-gram)."""
    out, row = [], 0
    for drafts, q, p_params, g in zip(draft_token_ids, draft_probs, params, generators, strict=True):
        k = len(drafts)
        rows = logits[row : row + k + 1].float()  # [k + 1, V]
        row += k + 1
        if p_params.greedy:
            target = rows.argmax(dim=-1).tolist()  # [k + 1]: the target's token at every position
            m = next((i for i, d in enumerate(drafts) if d != target[i]), k)  # accepted drafts
            out.append(list(drafts[:m]) + [target[m]])
            continue
        p = filtered_probs(rows, [p_params] * (k + 1))  # [k + 1, V]
        ids = torch.tensor(drafts, dtype=torch.long, device=p.device)  # [k]
        if q is None:  # an n-gram guess is certain: q is one-hot on it
            q = torch.zeros_like(p[:k]).scatter_(1, ids[:, None], 1.0)  # [k, V]
        q = q.to(p.device, torch.float32)
        u = torch.rand(k + 1, generator=g, device=g.device).to(p.device)  # [k + 1]: k tests, one final draw
        p_d, q_d = p[:k].gather(1, ids[:, None])[:, 0], q.gather(1, ids[:, None])[:, 0]  # [k] each
        accept = u[:k] * q_d < p_d  # u < p(d) / q(d), without dividing by a zero q
        m = int(accept.cumprod(dim=0).sum())  # drafts accepted before the first rejection
        if m < k:  # rejected at m: the leftover mass of p that q did not cover
            residual = (p[m] - q[m]).clamp(min=0)
            last = residual if residual.sum() > 0 else p[m]
        else:  # every draft passed: a bonus token from the target's next distribution
            last = p[k]
        out.append(list(drafts[:m]) + [int(draw(last[None], u[k : k + 1]))])
    return out
