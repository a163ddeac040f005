"""Log-probabilities in OpenAI's two response formats, made from the engine's (vLLM's) shape.

The engine gives one dict per token, {token id: Logprob(logprob, rank, decoded_token)}: the chosen token first
(with its true rank), then the `N` most likely tokens (roseinfer/outputs.py). The values are the model's own
log-softmax, before penalties and temperature. The two APIs lay the same numbers out differently:

    /v1/completions   "logprobs": {"tokens":         [" the", " king"],
                                   "token_logprobs": [-1.20, -0.31],
                                   "top_logprobs":   [{" the": -1.20, " a": -2.05}, {" king": -0.31, …}],
                                   "text_offset":    [0, 4]}          where each token starts in the text
    /v1/chat/…        "logprobs": {"content": [{"token": " the", "logprob": -1.2, "bytes": [32, 116, 104, 101],
                                                "top_logprobs": [{"token": " the", "logprob": -1.2, "bytes": …},
                                                                 {"token": " a", …}]}, …]}

A completion's `top_logprobs` holds the chosen token and the top N (N + 1 entries when the chosen one is not
among them, as vLLM's); a chat's holds exactly the top N. With `echo`, a completion's lists start with the
prompt's tokens, the first of which has no logprob (null): nothing comes before it. JSON has no -infinity, so
a logprob below -9999 is sent as -9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable

from roseinfer.outputs import Logprob

FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


def top_n(position: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The position's N most likely tokens, most likely first."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda e: e[1].rank)


class CompletionLogprobs:
    """One choice's logprobs in the completions format, built chunk by chunk: `add` returns the part for this
    chunk's tokens (the text offsets carry on from the chunks before)."""

    def __init__(self, n: int, token_text: Callable[[int], str]):
        self.n, self.token_text, self.offset = n, token_text, 0

    def add(self, token_ids: list[int], positions: list[dict[int, Logprob] | None]) -> dict:
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, position in zip(token_ids, positions, strict=True):
            text = position[t].decoded_token if position is not None else self.token_text(t)
            text = text if text is not None else self.token_text(t)
            part["tokens"].append(text)
            part["text_offset"].append(self.offset)
            self.offset += len(text)
            if position is None:  # the first prompt token: no logprob
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
                continue
            part["token_logprobs"].append(_value(position[t]))
            top = {text: _value(position[t])}
            for tok, lp in top_n(position, self.n):
                top[lp.decoded_token if lp.decoded_token is not None else self.token_text(tok)] = _value(lp)
            part["top_logprobs"].append(top)
        return part


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """The parts of one choice's chunks, joined into the whole answer's."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for part in parts for x in part[k]] for k in keys}


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], n: int,
                  token_bytes: Callable[[int], bytes]) -> dict:  # fmt: skip
    """The chat format's `{"content": [...]}` for these tokens."""

    def entry(t: int, lp: Logprob) -> dict:
        raw = token_bytes(t)
        text = lp.decoded_token if lp.decoded_token is not None else raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": _value(lp), "bytes": list(raw)}

    content = []
    for t, position in zip(token_ids, positions, strict=True):
        e = entry(t, position[t])
        e["top_logprobs"] = [entry(tok, lp) for tok, lp in top_n(position, n)]
        content.append(e)
    return {"content": content}
