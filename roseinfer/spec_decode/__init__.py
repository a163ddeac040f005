"""Speculative decoding (stage 14): guess k tokens cheaply, check them all in ONE forward of the model.

Decode computes one token per request per forward. But a forward over 1 + k tokens of a request costs
about as much as over 1 when decode is memory-bound (the weights are read once either way), so:

    propose    a cheap proposer guesses the next k tokens           d1 d2 d3 d4        (k = 4)
    verify     one forward of the target over [last, d1 .. d4]      p0 p1 p2 p3 p4     (5 next-token distributions)
    accept     keep the drafts the target agrees with, then one     d1 d2 ✓ ✓ ✗ → d1 d2 t3
               token of the target's own at the first miss          (or a bonus t5 if all 4 pass)

Every step still yields at least one token, and the tokens are exactly the ones the target would
have produced (greedy) or are distributed exactly as its samples (rejection sampling, see
`rejection_sampler.py`). Two proposers share one interface (`Proposer`):

    ngram          prompt lookup: find the request's last n tokens earlier in its own prompt + output,
                   propose what followed them there (no model at all)            `ngram.py`
    draft_model    a small model with the same tokenizer, run k times over its own paged KV cache
                                                                                 `draft_model.py`

`SpeculativeConfig` takes vLLM's keys, so `speculative_config={"method": "ngram", "num_speculative_tokens": 4}`
means the same here and there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from roseinfer.checks import is_int
from roseinfer.session import InferenceSession

if TYPE_CHECKING:
    from roseinfer.engine import InferenceEngine

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's keys. `num_speculative_tokens` is k, the drafts proposed per request per step.
    ngram: the n-gram length tried first (`prompt_lookup_max`, default 5) down to the shortest
    (`prompt_lookup_min`, default 1); draft_model: `model`, a directory (or hub id) of a GPT-2 with the
    target's vocabulary."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys are {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's path")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = 1 if lo is None else lo
            hi = max(5, lo) if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not is_int(v) or v < 1:
                    raise ValueError(f"{name} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi


class Proposer(Protocol):
    def propose(self, seqs: list[InferenceSession]) -> None:
        """Set `spec_token_ids` (and, for a model that samples, `spec_draft_probs`) on each sequence:
        at most `max_spec_tokens(seq, k)` guesses of its next tokens. Forget any state kept for sequences
        not in `seqs` (finished, preempted, or not decoding)."""

    def free(self, request_id: str) -> None:
        """A request has ended: forget what is kept for it."""


def max_spec_tokens(seq: InferenceSession, k: int) -> int:
    """Drafts worth proposing: a step yields up to drafts + 1 tokens, so never more than the request may
    still generate (max_tokens) or the context can hold, minus one."""
    left = min(seq.params.max_tokens - len(seq.output_ids), seq.max_context - seq.num_tokens)
    return max(0, min(k, left - 1))


def can_speculate(seq: InferenceSession) -> bool:
    """A request speculates when it is decoding (only its last token lacks K/V) and is alone: the
    sequences of n > 1 and beam search take one token per step (stage 11)."""
    return seq.group is None and seq.num_computed_tokens == seq.num_tokens - 1


def make_proposer(config: SpeculativeConfig, engine: InferenceEngine, num_blocks: int) -> Proposer:
    if config.method == "ngram":
        from roseinfer.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    from roseinfer.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(engine, config.model, config.num_speculative_tokens, num_blocks)
