"""How a request picks its tokens and when it stops: SamplingParams and BeamSearchParams (vLLM's names).

Both are plain, checked data: the engine reads them, the model runner turns the numbers into per-row
tensors of its batch (roseinfer/worker/input_batch.py), and the sampler (roseinfer/sample/sampler.py)
does the maths for the whole batch at once.

`output_kind` (vLLM's RequestOutputKind) says what `LLMEngine.step()` hands back for a request:

    CUMULATIVE   an output at every step that gives it tokens: all text and tokens so far, and the
                 step's new text in `delta` (the default; reading `.text` joins the text then, not before)
    DELTA        an output at every such step, with only the new tokens and text (what a stream sends)
    FINAL_ONLY   one output, when the request finishes (`LLM.generate`: the text is built once)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from roseinfer.checks import is_int, is_number

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (field names as in vLLM)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0  # keep the smallest set of tokens whose probability mass is >= top_p
    max_tokens: int = 16  # new tokens at most
    seed: int | None = None  # None = a fresh random stream
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going after EOS (benchmarks use it for exact lengths)
    n: int = 1  # completions per prompt: n sequences that share the prompt's KV blocks
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stop, ids = self.stop or [], self.stop_token_ids or []
        _check(isinstance(stop, (list, tuple)), f"stop must be a string or a list of strings, got {stop!r}")
        _check(isinstance(ids, (list, tuple)), f"stop_token_ids must be a list of ints, got {ids!r}")
        self.stop, self.stop_token_ids = list(stop), list(ids)
        t, k, p, n, seed = self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed
        _check(is_number(t), f"temperature must be a finite number, got {t!r}")
        _check(t >= 0, f"temperature must be >= 0 (0 means greedy), got {t}")
        _check(is_int(k) and (k == -1 or k >= 1), f"top_k must be -1 (disabled) or an int >= 1, got {k!r}")
        _check(is_number(p) and 0 < p <= 1, f"top_p must be a number in (0, 1], got {p!r}")
        _check(is_int(n) and n >= 1, f"max_tokens must be an int >= 1, got {n!r}")
        lo, hi = SEED_RANGE
        _check(seed is None or (is_int(seed) and lo <= seed <= hi),
               f"seed must be None or an int in [-2**63, 2**64 - 1], got {seed!r}")  # fmt: skip
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")  # fmt: skip
        for s in self.stop:
            _check(isinstance(s, str) and s != "", f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check(is_int(t) and t >= 0, f"stop_token_ids must be ints >= 0, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device: torch.device | str = "cpu", index: int = 0) -> torch.Generator | None:
        """The random stream of completion `index` when `seed` is set: seeded with `seed + index`, so each of
        n completions draws its own numbers, the same every run. None without a seed: the row then draws
        from the sampler's shared stream, as every unseeded row of the batch does."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed((self.seed + index) % 2**64 if self.seed >= 0 else _wrap(self.seed - index))
        return g


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's names): keep the `beam_width` best sequences by cumulative log-probability,
    extend each by every token, keep the best `beam_width` again. Finished hypotheses are ranked by
    cum_logprob / generated_length ** length_penalty, as in Hugging Face `generate(num_beams=...)`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        w, n, lp = self.beam_width, self.max_tokens, self.length_penalty
        _check(is_int(w) and w >= 1, f"beam_width must be an int >= 1, got {w!r}")
        _check(is_int(n) and n >= 1, f"max_tokens must be an int >= 1, got {n!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(is_number(lp), f"length_penalty must be a finite number, got {lp!r}")

    # what a beam reads where a sampling request reads its SamplingParams: a beam never samples or stops alone
    n, stop, stop_token_ids, output_kind = 1, (), (), RequestOutputKind.FINAL_ONLY


def _wrap(seed: int) -> int:
    """A negative seed minus an index may fall below -2**63; wrap it into the range torch accepts."""
    return seed if seed >= SEED_RANGE[0] else seed % 2**64


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)
