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

All verifying requests of a step are checked at once: their drafts are padded to the longest k into a
[S, K] table, acceptance is a [S, K] mask, and the number each keeps is the length of its leading run of
accepted drafts (a cumulative product). A seeded request draws its k + 1 uniform numbers from its own
generator, so it is reproducible whatever else verifies in the same step.
"""

from __future__ import annotations

import torch

from roseinfer.sample.sampler import SAMPLING_EPS, SamplingTensors, draw, filtered_probs, greedy_sample


def rejection_sample(
    logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    t: SamplingTensors,
) -> list[list[int]]:
    """The tokens each request gets this step: its accepted drafts, then one token of the target's.

    logits [sum(k_s + 1), V]: request s's k_s + 1 rows, one request after another; draft_token_ids[s]: its k_s
    drafts (k_s >= 1); draft_probs[s]: q of each draft [k_s, V], or None for one-hot guesses (n-gram);
    `t`: the sampling parameters, one row per request (its generator keyed by the request's index s)."""
    dev, S = logits.device, len(draft_token_ids)
    ks = [len(d) for d in draft_token_ids]
    K = max(ks)
    k = torch.tensor(ks, device=dev)  # [S]
    start = torch.cumsum(k + 1, 0) - (k + 1)  # [S] each request's first row
    j = torch.arange(K + 1, device=dev)  # [K + 1]
    rows = start[:, None] + torch.minimum(j[None, :], k[:, None])  # [S, K + 1] padded with the last row
    valid = j[None, :K] < k[:, None]  # [S, K] a real draft
    drafts = torch.zeros(S, K, dtype=torch.long, device=dev)
    drafts[valid] = torch.tensor([d for ds in draft_token_ids for d in ds], dtype=torch.long, device=dev)

    logits = logits.float()
    target = greedy_sample(logits).to(dev)[rows]  # [S, K + 1] the target's argmax at every position
    greedy = torch.ones(S, dtype=torch.bool, device=dev) if t.all_greedy else t.temperature < SAMPLING_EPS  # [S]
    accept = (drafts == target[:, :K]) & valid  # greedy rule
    sampled = ~greedy
    if sampled.any():  # min(1, p/q) tests, for the requests that sample
        p = filtered_probs(logits, _per_row(t, k + 1))  # [R, V] the target's distributions
        q = _draft_q(draft_probs, drafts, valid, p.shape[1])  # [S, K, V]
        p_pad = p[rows]  # [S, K + 1, V]
        p_d = p_pad[:, :K].gather(2, drafts[..., None])[..., 0]  # [S, K]
        q_d = q.gather(2, drafts[..., None])[..., 0]
        u = _uniforms(ks, t.generators, dev)  # [S, K + 1]
        accept = torch.where(sampled[:, None], (u[:, :K] * q_d < p_d) & valid, accept)
    m = accept.int().cumprod(dim=1).sum(dim=1)  # [S] drafts kept before the first miss
    last = target.gather(1, m[:, None])[:, 0]  # greedy: the target's token at the first miss (or the bonus)
    if sampled.any():
        idx = torch.arange(S, device=dev)
        p_m = p_pad[idx, m]  # [S, V] the target's distribution at the first miss
        q_m = q[idx, m.clamp(max=K - 1)] * (m < k)[:, None]  # the draft's there (none after the last draft)
        residual = (p_m - q_m).clamp(min=0)
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_m)
        u_last = u.gather(1, k[:, None])[:, 0]  # each request's (k_s + 1)-th number
        last = torch.where(sampled, draw(residual, u_last), last)
    return [list(ds[:n]) + [tok] for ds, n, tok in zip(draft_token_ids, m.tolist(), last.tolist(), strict=True)]


def _per_row(t: SamplingTensors, repeats: torch.Tensor) -> SamplingTensors:
    """Each request's parameters repeated over its k + 1 rows."""
    rep = lambda x: torch.repeat_interleave(x, repeats)  # noqa: E731
    return SamplingTensors(rep(t.temperature), rep(t.top_k), rep(t.top_p), t.all_greedy, t.needs_filter, {})


def _draft_q(draft_probs: list[torch.Tensor | None], drafts: torch.Tensor, valid: torch.Tensor, V: int) -> torch.Tensor:
    """q for every draft position, [S, K, V]: the draft model's distribution, or one-hot on an n-gram guess."""
    S, K = drafts.shape
    q = torch.zeros(S, K, V, device=drafts.device).scatter_(2, drafts[..., None], 1.0) * valid[..., None]
    for s, probs in enumerate(draft_probs):
        if probs is not None:
            q[s, : len(probs)] = probs.to(q.device, torch.float32)
    return q


def _uniforms(ks: list[int], generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """u ~ U(0, 1), [S, K + 1]: k_s + 1 per request (k_s tests, one final draw), a seeded request's from its own
    generator, exactly k_s + 1 of them, so its stream does not depend on the other requests."""
    u = torch.rand(len(ks), max(ks) + 1, device=device)
    for s, g in generators.items():
        u[s, : ks[s] + 1] = torch.rand(ks[s] + 1, generator=g, device=g.device).to(device)
    return u
