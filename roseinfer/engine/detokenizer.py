"""Streaming detokenizer: token ids in, text deltas out, as the tokens arrive.

Two traps:

1. A byte-level BPE token is a run of *bytes*, not characters. "🌹" is 4 UTF-8 bytes and
   may arrive as 2-3 tokens. Decoding each token alone would print "\\ufffd" garbage, so
   we feed bytes to an incremental UTF-8 decoder (`codecs`), which returns only the
   characters that are complete and keeps the rest for the next token.
2. A stop string ("\\n\\n", "THE END") may arrive split over several tokens. We hold back
   the last `len(longest stop) - 1` characters until we know they do not start a stop
   string, and emit the stop string itself only if asked to (`include_stop_str`).

With `min_tokens`, stop strings count only once more than min_tokens tokens are out (vLLM's rule): a stop
string that ends in the text of the first min_tokens tokens is ordinary text.

Each step costs O(token length + longest stop string): no re-decoding of the whole sequence, so a long
stream stays cheap. The text is kept as the list of emitted pieces and joined only when someone asks
for it; `text_at(k)` is the text as it was after k pieces, so an output of an earlier step can still
give its own text later.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class Detokenizer:
    def __init__(self, token_bytes: list[bytes], stop: Iterable[str] = (), skip_token_ids: Iterable[int] = (),
                 include_stop_str: bool = False, min_tokens: int = 0):  # fmt: skip
        """`token_bytes`: every token's bytes by id (`Tokenizer.token_bytes_table`); `skip_token_ids` make no
        text (EOS, stop token ids)."""
        self.token_bytes = token_bytes
        self.stop = list(stop)
        self.skip = frozenset(t for t in skip_token_ids if t is not None)
        self.include_stop_str, self.min_tokens = include_stop_str, min_tokens
        self._num_tokens = 0
        self._protected = 0  # chars at the start of _pending from the first min_tokens tokens: no stop may end there
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the incremental decoder holds the first bytes of a character
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # chars kept back
        self._pending = ""  # decoded text not emitted yet (at most _hold chars between steps)
        self.pieces: list[str] = []  # everything emitted so far (joined only when asked for)
        self.stopped = False  # a stop string was found

    @property
    def text(self) -> str:
        """All text emitted so far. O(length): call it at the end, not per token."""
        return "".join(self.pieces)

    def text_at(self, num_pieces: int) -> str:
        return "".join(self.pieces[:num_pieces])

    def step(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self._num_tokens += 1
        if token_id in self.skip:
            return ""
        table = self.token_bytes
        data = table[token_id] if token_id < len(table) else b""
        if self._partial:
            text = self._utf8.decode(data)
            self._partial = bool(self._utf8.getstate()[0])
        else:
            try:  # most tokens are whole characters: bytes.decode is much cheaper than the incremental decoder
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = self._utf8.decode(data)
                self._partial = bool(self._utf8.getstate()[0])
        if not self.stop:  # nothing to hold back: every complete character is final at once
            if text:
                self.pieces.append(text)
            return text
        self._pending += text
        if self._num_tokens <= self.min_tokens:
            self._protected = len(self._pending)
        return self._release(final=False)

    def flush(self) -> str:
        """The stream ended (EOS, length): emit whatever is held, incomplete bytes as U+FFFD."""
        if self.stopped:
            return ""
        self._pending += self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending, protected = self._pending, self._protected
        hits = [(i, len(s)) for s in self.stop if (i := pending.find(s, max(0, protected - len(s) + 1))) >= 0]
        if hits:  # cut at the earliest stop string (after it, with include_stop_str); drop everything after
            i, n = min(hits)
            out, self._pending, self.stopped = pending[: i + n if self.include_stop_str else i], "", True
        elif final or len(pending) <= self._hold:
            out, self._pending = (pending, "") if final else ("", pending)
        else:
            cut = len(pending) - self._hold
            out, self._pending = pending[:cut], pending[cut:]
            self._protected = max(0, protected - cut)
        if out:
            self.pieces.append(out)
        return out
