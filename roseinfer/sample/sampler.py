"""Sampling for a whole batch at once: one row of logits per request that gets a token this step.

How one row's next token is chosen:

    logits ─► processors ─► ÷ temperature ─► softmax ─► min_p ─► keep top_k ─► keep top_p mass ─► draw
              (bias, min_tokens,                                          (greedy rows: argmax after the processors)
               penalties: logits_processor.py)

The parameters are columns, one entry per row (`SamplingTensors`, gathered from the model runner's
persistent batch), so there is no loop over requests:

    temperature [S]   0 rows are greedy (any temperature below 1e-5, as in vLLM: dividing by a tinier
                      number overflows float32)
    top_k [S]         V where disabled
    top_p [S]         1.0 where disabled
    processors        penalties, logit_bias, min_tokens, min_p: None when no row of the step uses any

Drawing from the filtered distribution p is the "exponential race" (the Gumbel-max trick): with q_i ~ Exp(1)
independent, argmax_i p_i / q_i is i with probability p_i / Σp. It needs no sort and no cumulative sum, and
p need not be normalised. A seeded request draws its row of q from its own `torch.Generator`, so the same
seed gives the same text whatever else is in the batch; every other row draws from one shared stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.sample.logits_processor import LogitsProcessors, apply_min_p
from roseinfer.sampling_params import SAMPLING_EPS


@dataclass
class SamplingTensors:
    """The sampling parameters of a step's S rows (on the logits' device)."""

    temperature: torch.Tensor | None  # [S] float32 (None when every row is greedy: only the argmax is needed)
    top_k: torch.Tensor | None  # [S] int64, V where disabled
    top_p: torch.Tensor | None  # [S] float32
    all_greedy: bool  # no row samples: skip everything but the argmax
    needs_filter: bool  # some row has top_k < V or top_p < 1
    generators: dict[int, torch.Generator]  # row -> its own random stream (seeded requests only)
    processors: LogitsProcessors | None = None  # None: no row uses a logits processor (the common case)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row, [S, V] -> [S] int64. On a CPU numpy's argmax is about ten times faster than torch's for
    a [256, 4096] batch on one thread (the engine step's profile shows it); both return the first maximum."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row: [S, V] -> [S] int64. The processors change float32 `logits` in place."""
    logits = logits.float()
    if t.processors is not None:
        logits = t.processors.apply(logits)
    if t.all_greedy:
        return greedy_sample(logits)
    probs = filtered_probs(logits, t, normalize=False)  # [S, V]
    sampled = random_sample(probs, t.generators)
    greedy = t.temperature < SAMPLING_EPS
    return torch.where(greedy, greedy_sample(logits), sampled)


def filtered_probs(logits: torch.Tensor, t: SamplingTensors, normalize: bool = True) -> torch.Tensor:
    """Temperature, softmax, top-k and top-p: the distribution a row draws from, in vocabulary order
    ([S, V] -> [S, V]). Greedy rows use temperature 1. Speculative decoding compares these whole: the target's
    p and the draft's q, token by token."""
    temp = torch.where(t.temperature < SAMPLING_EPS, 1.0, t.temperature)  # [S]
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)  # [S, V]
    if t.processors is not None and t.processors.min_p is not None:
        probs = apply_min_p(probs, t.processors.min_p)
    if t.needs_filter:
        probs = top_k_top_p(probs, t.top_k, t.top_p)
    if normalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside a row's top_k most likely and outside the smallest set whose mass reaches top_p
    (the most likely token is always kept). [S, V] -> [S, V], not renormalised."""
    V = probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [S, V], most likely first
    rank = torch.arange(V, device=probs.device)[None, :]  # [1, V]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # probability of all more-likely tokens
    keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
    return torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The exponential race: argmax(p / q) with q ~ Exp(1). [S, V] -> [S] int64."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()  # the shared stream, for every row without a seed
    for row, g in generators.items():  # seeded rows: their own stream (the only per-row work)
        q[row].exponential_(generator=g)
    return (probs / q).argmax(dim=-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of an (unnormalised) distribution, by inverse CDF with u ~ U(0, 1) given.
    probs [B, V], u [B] -> token ids [B]"""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # first token whose CDF passes u
    return pos.clamp_(max=probs.shape[1] - 1)[:, 0]


def uniforms(n: int, rows: list[int], generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """u ~ U(0, 1), n per row, [len(rows), n]: a seeded row's from its own stream, the rest from the shared one."""
    u = torch.rand(len(rows), n, device=device)
    for i, row in enumerate(rows):
        g = generators.get(row)
        if g is not None:
            u[i] = torch.rand(n, generator=g, device=g.device).to(device)
    return u
