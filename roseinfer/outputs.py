"""What `LLM.generate` and `LLM.beam_search` return for each prompt (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's `n` completions (stage 11)."""

    index: int  # 0 .. n-1
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    cumulative_logprob: float | None = None  # sum of the log-probabilities of token_ids (None: not tracked)


@dataclass
class RequestOutput:
    """What a caller gets back (the names of vLLM's RequestOutput). `text`, `token_ids` and
    `finish_reason` are the first completion's, so code written for n = 1 keeps working."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token, stop string) | "length" | "abort" | None while running
    delta: str = ""  # text that became final in the last engine step (streaming)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (stage 10)
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n completions (stage 11)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchSequence:
    """A finished beam: the generated tokens (an EOS included if it ended there) and their log-probability."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty, the ranking key


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]
