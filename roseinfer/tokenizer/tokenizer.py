"""Text <-> token ids, on tiktoken.

A model directory may carry `tokenizer.tiktoken`: one `base64(token bytes) rank` pair per
line, the format of tiktoken's own .tiktoken files. Ranks are the token ids, and a lower
rank is merged first, which is exactly byte-level BPE. Checkpoints saved by `transformers`
carry GPT-2's files instead (vocab.json + merges.txt, tokenizer.json), which
`roseinfer/tokenizer/hf_tokenizer.py` turns into the same ranks. `Tokenizer.from_model_dir` looks, in order:

    1. tokenizer.tiktoken           ours
    2. vocab.json + merges.txt      GPT-2's files
    3. tokenizer.json               if it is a GPT-2 byte-level BPE
    4. tiktoken's "gpt2" encoding   for a 50257-token GPT-2, if tiktoken has it cached

A tokenizer.json of another kind (Llama 3's BOS-adding post-processor, Qwen2's normalizer,
SentencePiece's "▁" and byte tokens ...) is what tiktoken cannot run: `from_model_dir` hands the
directory to `FastTokenizer` (fast_tokenizer.py, on the `tokenizers` library), which has the same
interface. GPT-2's own kind stays on tiktoken, errors included.

Special tokens (<|endoftext|>, tokenizer.json's added tokens) are matched in the text first,
as transformers does, so the literal "<|endoftext|>" in a prompt is one token.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import tempfile
from pathlib import Path

import tiktoken

from roseinfer.tokenizer.fast_tokenizer import FastTokenizer
from roseinfer.tokenizer.hf_tokenizer import EOT, is_gpt2_tokenizer_json, load_gpt2_bpe
from roseinfer.tokenizer.tokenizer_config import load_chat_template, read_tokenizer_config, special_tokens_map

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


# tiktoken's "gpt2" encoding is built from these two files, cached under sha1(url) once downloaded
GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


def tiktoken_cache_dir() -> str:
    """Where tiktoken keeps downloads (its own rule: "" means no cache)."""
    default = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR", default))


def cached_gpt2_encoding() -> tiktoken.Encoding | None:
    """tiktoken's "gpt2" encoding if both its files are in tiktoken's cache, else None (no download)."""
    cache = tiktoken_cache_dir()
    if cache and all(os.path.exists(os.path.join(cache, hashlib.sha1(u.encode()).hexdigest())) for u in GPT2_URLS):
        return tiktoken.get_encoding("gpt2")
    return None


class Tokenizer:
    """A thin wrapper over `tiktoken.Encoding` with the few things the engine needs."""

    def __init__(self, encoding: tiktoken.Encoding, source: str = ""):
        self.encoding = encoding
        self.source = source  # the file(s) it was read from
        specials = encoding.special_tokens_set
        self.eos_token_id: int | None = encoding.encode_single_token(EOT) if EOT in specials else None
        self.vocab_size: int = encoding.n_vocab
        self.special_ids = sorted(encoding.encode_single_token(t) for t in specials)  # the ids that make no text
        # for chat templates: GPT-2's named special tokens (transformers' defaults) and the model's template
        names = ("bos_token", "eos_token", "unk_token")
        self.special_tokens_map: dict[str, str] = dict.fromkeys(names, EOT) if EOT in specials else {}
        self.bos_token_id: int | None = self.eos_token_id
        self.chat_template: str | dict[str, str] | None = None

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int | None = None) -> Tokenizer | FastTokenizer:
        """The first tokenizer found in the search order above. `vocab_size` is the model's: the
        tokenizer must not produce ids beyond it."""
        model_dir = Path(model_dir)
        tok = cls._find(model_dir, vocab_size)
        if isinstance(tok, Tokenizer):
            tok._read_chat_config(model_dir)
        if vocab_size is not None and tok.vocab_size > vocab_size:
            raise ValueError(
                f"the tokenizer in {str(model_dir)!r} ({tok.source}) has ids up to {tok.vocab_size - 1}, "
                f"but the model's vocab_size is {vocab_size}"
            )
        return tok

    def _read_chat_config(self, model_dir: Path) -> None:
        """The special token names and the chat template of tokenizer_config.json / chat_template.jinja."""
        config = read_tokenizer_config(model_dir)
        specials = self.encoding.special_tokens_set
        self.special_tokens_map = special_tokens_map(config, self.special_tokens_map)
        bos = self.special_tokens_map.get("bos_token")
        self.bos_token_id = self.encoding.encode_single_token(bos) if bos in specials else None
        self.chat_template = load_chat_template(model_dir, config)

    @classmethod
    def _find(cls, model_dir: Path, vocab_size: int | None) -> Tokenizer | FastTokenizer:
        path = model_dir / "tokenizer.tiktoken"
        if path.exists():
            ranks = read_tiktoken_file(path)
            special = {EOT: len(ranks)}
            return cls(tiktoken.Encoding(model_dir.name, pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                         special_tokens=special), "tokenizer.tiktoken")  # fmt: skip
        tj = model_dir / "tokenizer.json"
        if tj.exists() and not is_gpt2_tokenizer_json(tj):  # tiktoken would refuse it: the tokenizers library runs it
            return FastTokenizer.from_model_dir(model_dir)
        found = load_gpt2_bpe(model_dir)
        if found is not None:
            ranks, special, source = found
            enc = tiktoken.Encoding(model_dir.name, pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens=special)
            return cls(enc, source)
        gpt2 = vocab_size == 50257  # the original GPT-2 vocabulary (gpt2, gpt2-medium, distilgpt2 ...)
        if gpt2 and (enc := cached_gpt2_encoding()) is not None:
            return cls(enc, "tiktoken's cached 'gpt2' encoding")
        looked = "tokenizer.tiktoken, vocab.json + merges.txt, tokenizer.json"
        if gpt2:
            looked += f", tiktoken's 'gpt2' encoding in its cache ({tiktoken_cache_dir() or 'caching is off'})"
        raise FileNotFoundError(f"no tokenizer found for model {str(model_dir)!r}: looked for {looked}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Like HF's GPT-2 tokenizer, special tokens in the text ("<|endoftext|>") become their own ids.
        # GPT-2 adds no BOS/EOS around a text, so `add_special_tokens` (FastTokenizer's) changes nothing.
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        """Decode to text; bytes that do not form valid UTF-8 become U+FFFD."""
        return self.encoding.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)

    @functools.cached_property
    def token_bytes_table(self) -> list[bytes]:
        """Every token's bytes, by id: what the streaming detokenizer looks up once per generated token
        (b"" for an id the encoding does not have)."""
        table = []
        for i in range(self.encoding.n_vocab):
            try:
                table.append(self.encoding.decode_single_token_bytes(i))
            except KeyError:
                table.append(b"")
        return table
