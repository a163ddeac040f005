"""What `LLM.generate`, `LLMEngine.step` and `LLM.beam_search` return (vLLM's shapes).

A streaming engine hands back an output for every request at every step, and each output shows all the
text and tokens so far. Building that text at every step would cost O(length) per request per step, so
`text`, `token_ids` and `logprobs` are snapshots taken lazily (`CompletionOutput.snapshot`): an output
records how many tokens (and text pieces) its request had at that step, and copies them only when read.
Reading `.text` of the last output once costs one join; never reading it costs nothing.

Log-probabilities (when a request asks for them with `logprobs` / `prompt_logprobs`) are vLLM's shape:
one dict per position, token id -> Logprob, holding the position's own token and the N most likely ones

    CompletionOutput.logprobs        [{464: Logprob(-0.31, rank=1, decoded_token=" the"), ...}, ...]
                                     one dict per generated token (its token plus the top N)
    RequestOutput.prompt_logprobs    [None, {11: Logprob(-5.2, rank=40, ...), ...}, ...]
                                     one per prompt token; the first has nothing to be predicted from
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's Logprob): the model's log-softmax, before any
    penalty or temperature; `rank` 1 is the most likely token (the count of tokens at least as likely);
    `decoded_token` is the token's own text (its bytes, decoded with errors="replace")."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token, None first


class CompletionOutput:
    """One of a request's `n` completions: index 0 .. n-1, its text and token ids, and why it ended ("stop",
    "length", "abort", "error", or None while it runs). `logprobs`: one dict per token of `token_ids`
    (None unless the request asked for them); `cumulative_logprob`: the sum of its tokens' log-probabilities
    (with logprobs, with n > 1, and for beams)."""

    __slots__ = ("index", "_text", "_token_ids", "_num_pieces", "_num_tokens", "finish_reason", "cumulative_logprob",
                 "_logprobs", "_num_logprobs")  # fmt: skip

    def __init__(self, index: int, text: str | list[str], token_ids: list[int], finish_reason: str | None = None,
                 cumulative_logprob: float | None = None, num_pieces: int | None = None,
                 num_tokens: int | None = None, logprobs: SampleLogprobs | None = None):  # fmt: skip
        """`num_pieces` / `num_tokens` given: `text` is a list of text pieces and `token_ids` (and `logprobs`, one
        entry per token) lists, all of which only grow, and this completion is their first pieces and ids (see
        `snapshot`)."""
        self.index, self._text, self._token_ids = index, text, token_ids
        self._num_pieces, self._num_tokens = num_pieces, num_tokens
        self.finish_reason, self.cumulative_logprob = finish_reason, cumulative_logprob
        self._logprobs, self._num_logprobs = logprobs, (num_tokens if logprobs is not None else None)

    @classmethod
    def snapshot(cls, index: int, pieces: list[str], token_ids: list[int], finish_reason: str | None,
                 cumulative_logprob: float | None, logprobs: SampleLogprobs | None = None,
                 ) -> CompletionOutput:  # fmt: skip
        """The completion as it is now, of lists that only grow: their lengths are noted, nothing is copied;
        `text` joins the first pieces, `token_ids` and `logprobs` slice the first entries, when read."""
        return cls(index, pieces, token_ids, finish_reason, cumulative_logprob, len(pieces), len(token_ids), logprobs)

    @property
    def text(self) -> str:
        if self._num_pieces is not None:
            self._text, self._num_pieces = "".join(self._text[: self._num_pieces]), None
        return self._text

    @property
    def token_ids(self) -> list[int]:
        if self._num_tokens is not None:
            self._token_ids, self._num_tokens = self._token_ids[: self._num_tokens], None
        return self._token_ids

    @property
    def logprobs(self) -> SampleLogprobs | None:
        if self._num_logprobs is not None:
            self._logprobs, self._num_logprobs = self._logprobs[: self._num_logprobs], None
        return self._logprobs

    def _key(self) -> tuple:
        return self.index, self.text, self.token_ids, self.finish_reason, self.cumulative_logprob, self.logprobs

    def __eq__(self, other) -> bool:
        return isinstance(other, CompletionOutput) and self._key() == other._key()

    def __repr__(self) -> str:
        lp = "" if self.logprobs is None else f", logprobs={self.logprobs}"
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r}, cumulative_logprob={self.cumulative_logprob}{lp})")  # fmt: skip


class RequestOutput:
    """What a caller gets back for one request (the names of vLLM's RequestOutput). `text`, `token_ids` and
    `finish_reason` are the first completion's, so code written for n = 1 keeps working; `outputs` has all n.
    `prompt_logprobs`: see the module docstring (None unless asked for; a DELTA stream carries it in its first
    output only). A request that failed inside the engine finishes with finish_reason "error", and `error`
    says why; the other requests of the batch go on."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "_outputs", "finish_reason", "delta", "num_cached_tokens",
                 "_snapshot", "prompt_logprobs", "error")  # fmt: skip

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 outputs: list[CompletionOutput] | None, finish_reason: str | None, delta: str = "",
                 num_cached_tokens: int = 0, snapshot: tuple | None = None,
                 prompt_logprobs: PromptLogprobs | None = None, error: str | None = None):  # fmt: skip
        """`outputs`, or (one completion, as a step of a stream sees it) `snapshot`: (its text pieces, its token
        ids, its logprobs or None, its cumulative log-probability), lists that only grow, whose lengths now are
        noted; `outputs` is then made when first read."""
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self._outputs, self.finish_reason = outputs, finish_reason
        self.delta = delta  # text that became final in the last engine step (streaming)
        self.num_cached_tokens = num_cached_tokens  # prompt tokens whose K/V came from the prefix cache
        self.prompt_logprobs, self.error = prompt_logprobs, error
        if snapshot is not None:
            pieces, ids, logprobs, cum = snapshot
            self._snapshot = (pieces, len(pieces), ids, len(ids), logprobs, cum)

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self._outputs is None:
            pieces, n_pieces, ids, n_ids, logprobs, cum = self._snapshot
            self._outputs = [CompletionOutput(0, pieces, ids, self.finish_reason, cum, n_pieces, n_ids, logprobs)]
        return self._outputs

    @property
    def text(self) -> str:
        outputs = self.outputs
        return outputs[0].text if outputs else ""

    @property
    def token_ids(self) -> list[int]:
        outputs = self.outputs
        return outputs[0].token_ids if outputs else []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        err = "" if self.error is None else f", error={self.error!r}"
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"finish_reason={self.finish_reason!r}, outputs={self.outputs}{err})")  # fmt: skip


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
