"""Streaming detokenizer: token ids in, text deltas out, as the tokens arrive.

Two traps:

1. A byte-level BPE token is a run of *bytes*, not characters. "🌹" is 4 UTF-8 bytes and
   may arrive as 2-3 tokens. Decoding each token alone would print "\\ufffd" garbage, so
   we feed bytes to an incremental UTF-8 decoder (`codecs`), which returns only the
   characters that are complete and keeps the rest for the next token.
2. A stop string ("\\n\\n", "THE END") may arrive split over several tokens. We hold back
   the last `len(longest stop) - 1` characters until we know they do not start a stop
   string, and never emit the stop string itself.

Each step costs O(token length + longest stop string): no re-decoding of the whole
sequence, so a long stream stays cheap.
"""

from __future__ import annotations

import codecs
import copy
from collections.abc import Iterable

from roseinfer.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = (), skip_token_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip = set(skip_token_ids)  # special tokens (EOS) produce no text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # chars kept back
        self._pending = ""  # decoded text not emitted yet (at most _hold chars between steps)
        self._pieces: list[str] = []  # everything emitted so far (joined only when asked for)
        self.stopped = False  # a stop string was found

    def fork(self) -> Detokenizer:
        """A copy that goes on independently (stage 11: a forked sequence continues the same text)."""
        child = copy.copy(self)
        child._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        child._utf8.setstate(self._utf8.getstate())  # bytes of a half-decoded character carry over
        child._pieces = list(self._pieces)
        return child

    @property
    def text(self) -> str:
        """All text emitted so far. O(length): call it at the end, not per token."""
        return "".join(self._pieces)

    def step(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        if token_id not in self.skip:
            self._pending += self._utf8.decode(self.tokenizer.token_bytes(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        """The stream ended (EOS, length): emit whatever is held, incomplete bytes as U+FFFD."""
        if self.stopped:
            return ""
        self._pending += self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:  # cut at the earliest stop string; drop it and everything after
            out, self._pending, self.stopped = self._pending[: min(hits)], "", True
        elif final or len(self._pending) <= self._hold:
            out, self._pending = (self._pending, "") if final else ("", self._pending)
        else:
            cut = len(self._pending) - self._hold
            out, self._pending = self._pending[:cut], self._pending[cut:]
        if out:
            self._pieces.append(out)
        return out
