"""Sampling: SamplingParams (vLLM's names) and a vectorised sampler over a [B, V] batch.

How one row's next token is chosen:

    logits ─► ÷ temperature ─► softmax ─► sort ↓ ─► keep top_k ─► keep top_p mass ─► draw u ~ U(0,1)
                                                                                    pick where CDF ≥ u·mass

temperature 0 means greedy (argmax), and so does any temperature below 1e-5 (as in vLLM: dividing
the logits by a tinier number overflows float32). Each request owns a `torch.Generator`, so the same
seed gives the same text every run, whatever else is in the batch: the only per-row work
is drawing that row's one uniform number; the math runs on the whole batch at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (field names as in vLLM)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0  # keep the smallest set of tokens whose probability mass is >= top_p
    max_tokens: int = 16  # new tokens at most
    seed: int | None = None  # None = a fresh random seed
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going after EOS (benchmarks use it for exact lengths)
    n: int = 1  # completions per prompt (stage 11): n sequences that share the prompt's KV blocks

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stop, ids = self.stop or [], self.stop_token_ids or []
        _check(isinstance(stop, (list, tuple)), f"stop must be a string or a list of strings, got {stop!r}")
        _check(isinstance(ids, (list, tuple)), f"stop_token_ids must be a list of ints, got {ids!r}")
        self.stop, self.stop_token_ids = list(stop), list(ids)
        t, k, p, n, seed = self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed
        _check(_is_number(t), f"temperature must be a finite number, got {t!r}")
        _check(t >= 0, f"temperature must be >= 0 (0 means greedy), got {t}")
        _check(_is_int(k) and (k == -1 or k >= 1), f"top_k must be -1 (disabled) or an int >= 1, got {k!r}")
        _check(_is_number(p) and 0 < p <= 1, f"top_p must be a number in (0, 1], got {p!r}")
        _check(_is_int(n) and n >= 1, f"max_tokens must be an int >= 1, got {n!r}")
        lo, hi = SEED_RANGE
        _check(seed is None or (_is_int(seed) and lo <= seed <= hi),
               f"seed must be None or an int in [-2**63, 2**64 - 1], got {seed!r}")  # fmt: skip
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, f"stop_token_ids must be ints >= 0, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device: torch.device | str = "cpu", index: int = 0) -> torch.Generator:
        """The random stream of completion `index`: seeded with `seed + index` if `seed` is set (so each
        of n completions draws its own numbers, the same every run), else from OS entropy."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed((self.seed + index) % 2**64 if self.seed >= 0 else self.seed - index)
        return g


@dataclass
class BeamSearchParams:
    """Beam search (stage 11, vLLM's names): keep the `beam_width` best sequences by cumulative log-probability,
    extend each by every token, keep the best `beam_width` again. Finished hypotheses are ranked by
    cum_logprob / generated_length ** length_penalty, as in Hugging Face `generate(num_beams=...)`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        w, n, lp = self.beam_width, self.max_tokens, self.length_penalty
        _check(_is_int(w) and w >= 1, f"beam_width must be an int >= 1, got {w!r}")
        _check(_is_int(n) and n >= 1, f"max_tokens must be an int >= 1, got {n!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(_is_number(lp), f"length_penalty must be a finite number, got {lp!r}")

    # what the engine's sessions read from their params (class attributes, not fields): a beam never samples
    temperature, top_k, top_p, seed, n, greedy = 0.0, -1, 1.0, None, 1, True
    stop, stop_token_ids = (), ()

    def make_generator(self, device: torch.device | str = "cpu", index: int = 0) -> torch.Generator:
        return torch.Generator(device=device)  # never drawn from


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """An int or float that is finite as a float (not a bool, not inf or nan, not 10**400)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Pick one token per row. logits [B, V] -> token ids [B] (int64).

    Rows may use different params. Greedy rows take the argmax; the others go through
    temperature, top-k and top-p filtering and inverse-CDF sampling with their own generator.
    """
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)  # [B]
    if all(p.greedy for p in params):
        return greedy_ids
    # one uniform number per row, from that row's own generator (the only per-row loop)
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(logits.device)  # [B]
    probs, order = _sorted_filtered_probs(logits, params)  # [B, V], most likely first, not renormalised
    cdf = probs.cumsum(dim=-1)  # [B, V]
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=logits.shape[1] - 1)  # [B, 1]
    sampled_ids = order.gather(1, pos)[:, 0]  # back to vocabulary ids: [B]
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy_ids, sampled_ids)


def _sorted_filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, softmax, sort, top-k and top-p: the kept probabilities, most likely first, and the
    vocabulary id of each column ([B, V] both). Greedy rows use temperature 1."""
    B, V = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)  # [B]
    top_k = torch.tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params], device=dev)  # [B]
    top_p = torch.tensor([p.top_p for p in params], device=dev)  # [B]
    probs = torch.softmax(logits / temp[:, None], dim=-1)  # [B, V]
    probs, order = probs.sort(dim=-1, descending=True)  # [B, V], most likely first
    rank = torch.arange(V, device=dev)[None, :]  # [1, V]
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all more-likely tokens
    keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])  # top-1 is always kept
    return probs * keep, order  # [B, V], filtered (not renormalised: `sample` scales u instead)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Stage 14: the distribution `sample` draws from, as probabilities in vocabulary order. [B, V] -> [B, V]

    Speculative decoding needs it whole: the target's p and the draft's q are compared token by token."""
    probs, order = _sorted_filtered_probs(logits.float(), params)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # renormalise what top-k / top-p kept
    return torch.empty_like(probs).scatter_(1, order, probs)  # undo the sort


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stage 14: one token per row of an (unnormalised) distribution, by inverse CDF with u ~ U(0, 1).
    probs [B, V], u [B] -> token ids [B]"""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # first token whose CDF passes u
    return pos.clamp_(max=probs.shape[1] - 1)[:, 0]
