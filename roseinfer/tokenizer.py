"""Text <-> token ids, on tiktoken.

A model directory may carry `tokenizer.tiktoken`: one `base64(token bytes) rank` pair per
line, the format of tiktoken's own .tiktoken files. Ranks are the token ids, and a lower
rank is merged first, which is exactly byte-level BPE. GPT-2 checkpoints from the Hub
use tiktoken's built-in "gpt2" encoding instead.
"""

from __future__ import annotations

import base64
from pathlib import Path

import tiktoken

EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer: split into words / numbers / punctuation runs / whitespace
# before BPE, so merges never cross those boundaries.
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_tiktoken_file(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: expected 'base64-token rank', got {line!r}") from e
    return ranks


class Tokenizer:
    """A thin wrapper over `tiktoken.Encoding` with the few things the engine needs."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.eos_token_id: int = encoding.eot_token
        self.vocab_size: int = encoding.n_vocab

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int | None = None) -> Tokenizer:
        path = Path(model_dir) / "tokenizer.tiktoken"
        if path.exists():
            ranks = read_tiktoken_file(path)
            enc = tiktoken.Encoding(
                name=Path(model_dir).name, pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
            )
            return cls(enc)
        if vocab_size == 50257:  # the original GPT-2 vocabulary (gpt2, gpt2-medium, distilgpt2 ...)
            try:
                return cls(tiktoken.get_encoding("gpt2"))
            except Exception as e:
                raise OSError(
                    f"model {str(model_dir)!r} uses the GPT-2 vocabulary, but tiktoken could not load "
                    f"its 'gpt2' encoding ({type(e).__name__}: {e}); it downloads once and caches, "
                    f"so run once with internet access or set TIKTOKEN_CACHE_DIR"
                ) from e
        raise FileNotFoundError(
            f"no tokenizer found for model {str(model_dir)!r}: expected a tokenizer.tiktoken file "
            f"(or a GPT-2 model with the 50257-token vocabulary)"
        )

    def encode(self, text: str) -> list[int]:
        # Like HF's GPT-2 tokenizer, the literal text "<|endoftext|>" becomes the EOT token.
        return self.encoding.encode(text, allowed_special={EOT})

    def decode(self, ids: list[int]) -> str:
        """Decode to text; bytes that do not form valid UTF-8 become U+FFFD."""
        return self.encoding.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)
