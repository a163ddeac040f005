"""How a request picks its tokens and when it stops: SamplingParams and BeamSearchParams (vLLM's names).

Both are plain, checked data: the engine reads them, the model runner turns the numbers into per-row
tensors of its batch (roseinfer/worker/input_batch.py), and the sampler (roseinfer/sample/sampler.py)
does the maths for the whole batch at once. What each knob does to a row of logits, in order:

    logit_bias          logits[t] += bias[t]                                     (OpenAI's logit_bias)
    min_tokens          EOS and stop_token_ids at -inf until min_tokens are out  (stop strings unchecked too)
    repetition_penalty  every token of prompt or output: logit > 0 ? logit / p : logit * p    (HF's)
    frequency_penalty   logits[t] -= frequency_penalty · (times t was generated)              (OpenAI's)
    presence_penalty    logits[t] -= presence_penalty · (t was generated at all)
    temperature         logits / T (greedy: argmax of the logits so far)
    min_p               drop tokens with probability < min_p · the top token's probability
    top_k, top_p        keep the k most likely / the smallest set with mass >= top_p

`structured_outputs` (a `StructuredOutputsParams`) constrains the text to a JSON schema, any JSON object, a regular
expression, one of a list of choices or an EBNF grammar: the engine compiles it with xgrammar and masks every
token the grammar does not allow before the sampler sees the row (roseinfer/structured_output/).

`logprobs` / `prompt_logprobs` ask for the log-probabilities of the sampled / prompt tokens and of the N most
likely tokens at each position: the model's own log-softmax, before any of the knobs above (as vLLM's default).

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
MAX_LOGPROBS = 20  # most top log-probabilities per position (vLLM's default max_logprobs; OpenAI allows 20)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One constraint on the text a request may produce (vLLM's class and field names). Exactly one of

        json           a JSON schema (a dict, or its JSON text): the output is a JSON value that validates
        regex          a regular expression the whole output matches
        choice         a list of strings: the output is one of them
        grammar        an EBNF grammar (xgrammar's / GBNF syntax, the start rule named `root`)
        json_object    True: any JSON object (OpenAI's response_format {"type": "json_object"})

    and, for json and json_object, `disable_any_whitespace`: no free whitespace between JSON tokens (the
    compact form), `disable_additional_properties`: an object schema without "additionalProperties" allows
    no keys beyond its "properties". Whether a schema, regex or grammar compiles is checked when the request
    is added (roseinfer/engine/input_processor.py), so a bad one is a ValueError naming it."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        _check(len(kinds) <= 1, f"You can only use one kind of structured outputs constraint but multiple are "
                                f"specified: {kinds}")  # fmt: skip
        _check(len(kinds) == 1, f"You must use one kind of structured outputs constraint ({', '.join(CONSTRAINTS)}) "
                                "but none are specified")  # fmt: skip
        what = type(self.json).__name__
        _check(self.json is None or isinstance(self.json, (str, dict)),
               f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got {what}")  # fmt: skip
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, str) and v != ""),
                   f"structured_outputs.{name} must be a non-empty string, got {v!r}")  # fmt: skip
        c = self.choice
        _check(c is None or (isinstance(c, (list, tuple)) and len(c) > 0 and all(isinstance(x, str) for x in c)),
               f"structured_outputs.choice must be a non-empty list of strings, got {c!r}")  # fmt: skip
        if c is not None:
            self.choice = list(c)
        jo = self.json_object
        _check(jo is None or jo is True, f"structured_outputs.json_object must be True or None, got {jo!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            _check(isinstance(getattr(self, name), bool), f"structured_outputs.{name} must be True or False")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (field names as in vLLM)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0  # keep the smallest set of tokens whose probability mass is >= top_p
    max_tokens: int = 16  # new tokens at most
    seed: int | None = None  # None = a fresh random stream
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text, see include_stop_str_in_output)
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end a completion (they make no text)
    ignore_eos: bool = False  # keep going after EOS (benchmarks use it for exact lengths)
    n: int = 1  # completions per prompt: n sequences that share the prompt's KV blocks
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the number of times a token was generated
    repetition_penalty: float = 1.0  # > 0: tokens of prompt or output are divided (logit > 0) or multiplied by it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are impossible (stop strings unchecked) before this many tokens
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely one
    logprobs: int | None = None  # per generated token: its log-probability and the top `logprobs` (<= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    include_stop_str_in_output: bool = False  # keep the stop string (or the stop token's text) in the text
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(is_number(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        _check(is_number(r) and r > 0, f"repetition_penalty must be a number > 0 (1 = none), got {r!r}")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        m = self.min_tokens
        _check(is_int(m) and m >= 0, f"min_tokens must be an int >= 0, got {m!r}")
        _check(not is_int(n) or m <= n, f"min_tokens ({m}) must not exceed max_tokens ({n})")
        mp = self.min_p
        _check(is_number(mp) and 0 <= mp <= 1, f"min_p must be a number in [0, 1], got {mp!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
                   f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")  # fmt: skip
        inc = self.include_stop_str_in_output
        _check(isinstance(inc, bool), f"include_stop_str_in_output must be True or False, got {inc!r}")
        so = self.structured_outputs
        _check(so is None or isinstance(so, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams or None, got {type(so).__name__}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_logits_processors(self) -> bool:
        """Anything besides temperature, top-k and top-p that changes the logits (sample/logits_processor.py)."""
        return self.uses_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.min_p > 0

    @property
    def may_speculate(self) -> bool:
        """Speculative decoding (roseinfer/spec_decode/) runs only for requests that decode alone and plainly: one
        completion, no logits processor, no log-probabilities. Any other request is served as usual, one token per
        step, in the same batch: nothing is refused, its tokens are simply never drafted."""
        return self.n == 1 and not self.uses_logits_processors and self.logprobs is None

    def make_generator(self, device: torch.device | str = "cpu", index: int = 0) -> torch.Generator | None:
        """The random stream of completion `index` when `seed` is set: seeded with `derived_seed(seed, index)`,
        so each of n completions draws its own numbers, the same every run. None without a seed: the row then
        draws from the sampler's shared stream, as every unseeded row of the batch does."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(derived_seed(self.seed, index))
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
    # (its runner row returns candidates), and no logits processor or log-probability request applies to it
    n, stop, stop_token_ids, output_kind = 1, (), (), RequestOutputKind.FINAL_ONLY
    temperature, top_k, top_p, seed = 0.0, -1, 1.0, None
    logprobs = prompt_logprobs = logit_bias = None
    min_tokens, include_stop_str_in_output, uses_logits_processors, uses_penalties = 0, False, False, False
    structured_outputs = None  # a beam search follows no grammar (refused by the engine, by name)
    may_speculate = False


def derived_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded with `seed`: (seed + index) mod 2**64, a number in
    [0, 2**64) that torch.Generator.manual_seed always accepts, whatever the seed and however large n is.
    A negative seed counts as its two's-complement value, as manual_seed reads it (so completion 0 draws
    what a generator seeded with `seed` itself draws), and -1 + 1 wraps to 0."""
    return (seed + index) % 2**64


def _check_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}; keys may be ints or strings of ints (JSON object keys are strings). Ids are checked
    against the vocabulary by the engine, which knows it (roseinfer/engine/input_processor.py)."""
    if bias is None:
        return None
    _check(isinstance(bias, dict), f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        key = k
        if isinstance(k, str):
            try:
                key = int(k.strip())
            except ValueError:
                key = None
        _check(is_int(key) and key >= 0, f"logit_bias keys must be token ids (ints >= 0), got {k!r}")
        _check(is_number(v) and -100 <= v <= 100, f"logit_bias[{k!r}] must be a number in [-100, 100], got {v!r}")
        out[key] = float(v)
    return out


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)
