"""Text <-> token ids for any tokenizer.json (Llama, Qwen, Mistral ...), on Hugging Face's `tokenizers` library.

tiktoken (tokenizer.py) runs GPT-2's plain pipeline. Newer checkpoints put more around their BPE in
tokenizer.json: a normalizer (NFC), a pre-tokenizer regex of their own, a post-processor that adds a BOS,
added tokens by the hundred. The `tokenizers` library runs that file exactly as transformers does, so
`encode` is `tokenizers.Tokenizer.encode`, and it gives the ids `AutoTokenizer.from_pretrained(dir)(text)`
gives (added special tokens written in the text are matched as one token; `add_special_tokens=False` is how a
chat prompt that already starts with its BOS is tokenized).

Going back, the engine needs each token's *bytes* (the streaming detokenizer joins them and decodes UTF-8 as it
goes). tokenizer.json's decoder says how a token's string becomes text, and two kinds of vocabulary matter:

    byte-level BPE (GPT-2, Llama 3, Qwen2/3)   every byte has a printable stand-in: "Ġ" is b" ", "Ċ" is b"\\n",
        decoder ByteLevel                      so "Ġworld" is b" world" and "ðŁ" two bytes of an emoji
    SentencePiece BPE (Llama 2, Mistral)      "▁" marks a space: "▁world" is b" world"; a character outside the
        decoder Replace("▁", " ") + ByteFallback   vocabulary is spelled in byte tokens, "<0xF0>" is b"\\xf0"
                + Fuse + Strip (or Metaspace)

Special tokens (BOS, EOS, <|eot_id|>, <|im_end|> ...) make no text: b"", as vLLM skips them in output text by
default. Other added tokens (Qwen3's "<think>") go through the decoder like any token, as in `tokenizers`.
A decoder step that cannot be written as bytes per token (WordPiece's "##", a regex Replace) is refused.

One difference from transformers' `decode` is deliberate: a SentencePiece decoder drops the space of the first
"▁" of the whole text (Strip, or Metaspace on the first token), because a prompt's first word has no space in
front. Generated text continues a prompt, so here "▁Hello" is always b" Hello": `decode(generated)` is what
vLLM's detokenizer gives (it decodes after the prompt's last tokens), `decode(prompt + generated)` minus
`decode(prompt)` in transformers, and what the streaming detokenizer builds token by token. Also as in vLLM,
`clean_up_tokenization_spaces` (" ." -> ".") is not applied.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

from roseinfer.tokenizer.hf_tokenizer import byte_decoder
from roseinfer.tokenizer.tokenizer_config import (
    extra_special_tokens,
    load_chat_template,
    read_json,
    read_tokenizer_config,
    special_tokens_map,
)

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens, <0x00> .. <0xFF>


class FastTokenizer:
    """tokenizer.json through `tokenizers`, with `Tokenizer`'s interface (encode, decode, token_bytes,
    token_bytes_table, eos_token_id) plus what chat templates need (bos_token_id, special_tokens_map,
    chat_template)."""

    def __init__(self, tokenizer, to_bytes: Callable[[str], bytes], config: dict | None = None,
                 chat_template: str | dict[str, str] | None = None, source: str = "tokenizer.json"):  # fmt: skip
        """`tokenizer`: a `tokenizers.Tokenizer`; `to_bytes`: a token's string -> its bytes (`token_to_bytes_fn`)."""
        config = config or {}
        self._tokenizer, self._to_bytes, self.source = tokenizer, to_bytes, source
        self.special_tokens_map = special_tokens_map(config)
        _add_missing_special_tokens(tokenizer, list(self.special_tokens_map.values()) + extra_special_tokens(config))
        self.chat_template = chat_template
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = sorted(i for i, t in added.items() if t.special)  # the ids that make no text
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> FastTokenizer:
        """tokenizer.json (+ tokenizer_config.json, chat templates) from a model directory."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer found for model {str(model_dir)!r}: looked for tokenizer.json")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise ImportError(f"{path} needs the `tokenizers` library: pip install tokenizers") from e
        j = read_json(path)
        kind = (j.get("model") or {}).get("type")
        if kind != "BPE":  # WordPiece's "##", Unigram: not the two kinds of vocabulary this reads
            raise ValueError(f"{path}: model.type={kind!r} is not supported (BPE: byte-level or SentencePiece)")
        to_bytes = token_to_bytes_fn(j.get("decoder"), path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side says what it could not read
            raise ValueError(f"{path}: the tokenizers library cannot load it ({e})") from e
        tok.no_truncation()  # transformers pads / truncates only when asked to, per call
        tok.no_padding()
        config = read_tokenizer_config(model_dir)
        return cls(tok, to_bytes, config, load_chat_template(model_dir, config))

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the post-processor's tokens (a BOS) unless `add_special_tokens=False`.
        `encode_batch` of one text gives `encode`'s ids at the same cost, and releases the GIL while it works
        (`encode` holds it): a server tokenizing a long prompt in a thread keeps serving meanwhile."""
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as the streaming detokenizer builds it: their bytes joined, special tokens skipped,
        invalid UTF-8 as U+FFFD (see the module docstring for the first "▁")."""
        table = self.token_bytes_table
        return b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self.token_bytes_table):
            raise KeyError(token_id)
        return self.token_bytes_table[token_id]

    @functools.cached_property
    def token_bytes_table(self) -> list[bytes]:
        """Every token's bytes, by id (b"" for a special token or an unused id)."""
        table = [b""] * self.vocab_size
        special = set(self.special_ids)
        for token, i in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if i not in special:
                table[i] = self._to_bytes(token)
        return table

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]


def _add_missing_special_tokens(tokenizer, names: list[str]) -> None:
    """transformers adds the special tokens tokenizer_config.json names to the backend (and marks an added token of
    that name special): do the same, so the ids and the tokens skipped in text are the same."""
    from tokenizers import AddedToken

    added = {t.content: t for t in tokenizer.get_added_tokens_decoder().values()}
    new = []
    for name in dict.fromkeys(names):
        t = added.get(name)
        if t is None:
            new.append(AddedToken(name, special=True, normalized=False))
        elif not t.special:
            new.append(AddedToken(name, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                  normalized=t.normalized, special=True))  # fmt: skip
    if new:
        tokenizer.add_special_tokens(new)


# ---- a token's bytes, from tokenizer.json's decoder ----------------------------------------------------------
def token_to_bytes_fn(decoder: dict | None, path: Path | str = "tokenizer.json") -> Callable[[str], bytes]:
    """A function token string -> bytes that does, per token, what `decoder` does to the whole sequence, so that
    joining the tokens' bytes gives the decoded text. ValueError (naming `path` and the step) for a decoder
    that does not work token by token."""
    steps = _flatten(decoder, path)
    kinds = [s.get("type") for s in steps]
    if "ByteLevel" in kinds:  # byte-level BPE: the decoder is ByteLevel alone (Fuse adds nothing to it)
        other = [k for k in kinds if k not in ("ByteLevel", "Fuse")]
        if other:
            raise ValueError(f"{path}: decoder ByteLevel combined with {other} is not supported")
        return byte_level_token_bytes
    per_token: list[Callable[[str], str]] = []  # string -> string steps, applied to each token in order
    byte_fallback = fused = False
    for s in steps:
        kind = s.get("type")
        if kind in ("Replace", "Metaspace") and (byte_fallback or fused):
            raise ValueError(f"{path}: decoder {kind} after ByteFallback/Fuse is not supported")
        if kind == "Replace":
            pattern = s.get("pattern") or {}
            if "String" not in pattern:
                raise ValueError(f"{path}: decoder Replace with a regex pattern is not supported")
            per_token.append(functools.partial(_replace, old=pattern["String"], new=s.get("content", "")))
        elif kind == "Metaspace":  # "▁" -> " " (it also drops the first token's "▁": see the module docstring)
            per_token.append(functools.partial(_replace, old=s.get("replacement", "▁"), new=" "))
        elif kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip":
            if not fused:  # per token, before Fuse: exact
                if byte_fallback:
                    raise ValueError(f"{path}: decoder Strip between ByteFallback and Fuse is not supported")
                per_token.append(functools.partial(_strip, s.get("content", " "), s.get("start", 0), s.get("stop", 0)))
            elif s.get("stop", 0):  # the end of the whole text: unknown until the stream ends
                raise ValueError(f"{path}: decoder Strip of the text's last characters (stop > 0) is not supported")
            # Strip(start=1) after Fuse: the first space of the whole text; kept (see the module docstring)
        else:
            raise ValueError(f"{path}: decoder {kind} cannot be decoded token by token (supported: ByteLevel, "
                             f"Replace, ByteFallback, Fuse, Strip, Metaspace)")  # fmt: skip

    def sentencepiece_token_bytes(token: str) -> bytes:
        if byte_fallback and (m := BYTE_TOKEN.fullmatch(token)):
            return bytes([int(m.group(1), 16)])
        for step in per_token:
            token = step(token)
        return token.encode("utf-8")

    return sentencepiece_token_bytes


_BYTE_DECODER = byte_decoder()


def byte_level_token_bytes(token: str) -> bytes:
    """GPT-2's alphabet back to bytes; a token with a character outside it (an added token such as "<|im_start|>"
    is fine, it is all printable ASCII) stands for its own UTF-8, as in the ByteLevel decoder."""
    try:
        return bytes(_BYTE_DECODER[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _flatten(decoder: dict | None, path) -> list[dict]:
    if decoder is None:
        raise ValueError(f"{path} has no decoder: its tokens cannot be turned into text")
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _flatten(d, path)]
    return [decoder]


def _replace(token: str, old: str, new: str) -> str:
    return token.replace(old, new)


def _strip(content: str, start: int, stop: int, token: str) -> str:
    """tokenizers' Strip decoder on one token: up to `start` leading and `stop` trailing `content` characters."""
    n = len(token)
    i = 0
    while i < min(start, n) and token[i] == content:
        i += 1
    j = n
    while j > i and n - j < stop and token[j - 1] == content:
        j -= 1
    return token[i:j]
