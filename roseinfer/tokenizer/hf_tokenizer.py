"""GPT-2's Hugging Face tokenizer files -> tiktoken's mergeable ranks and special tokens.

A checkpoint saved by `transformers` carries its byte-level BPE in two forms:

    vocab.json + merges.txt   {token: id} and the merges, one "a b" per line, in priority order
    tokenizer.json            the same vocab and merges, plus the pipeline around them
                              (normalizer, pre-tokenizer, post-processor) and `added_tokens`

Tokens are written in GPT-2's printable alphabet: each byte is one character ("Ġ" is the
space byte 0x20), so "Ġthe" is the bytes b" the". tiktoken wants raw bytes, each with a
rank that is both its id and its merge priority. For GPT-2's own files tiktoken converts
them itself (`data_gym_to_mergeable_bpe_ranks`: the 256 bytes in GPT-2's order, then one new
token per merge, checked against vocab.json). Vocabularies trained with `tokenizers` may
number their tokens differently (special tokens first, say); then the ranks are vocab.json's
ids, after checking that they follow merge order, which is what makes a rank a priority.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from roseinfer.tokenizer.tokenizer_config import read_json, read_tokenizer_config, token_content

EOT = "<|endoftext|>"
Merges = list[tuple[str, str]]


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: printable bytes stand for themselves,
    the other 68 (control characters, space, ...) for chr(256 + n)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def load_gpt2_bpe(model_dir: Path) -> tuple[dict[bytes, int], dict[str, int], str] | None:
    """(mergeable ranks, special tokens, the files used) from vocab.json + merges.txt, else from
    tokenizer.json; None if the directory has neither. ValueError if they are not GPT-2's kind of BPE."""
    vocab_path, merges_path, tj_path = (model_dir / n for n in ("vocab.json", "merges.txt", "tokenizer.json"))
    tj = _read_tokenizer_json(tj_path) if tj_path.exists() else None
    config = _read_tokenizer_config(model_dir / "tokenizer_config.json")
    if vocab_path.exists() and merges_path.exists():
        source = "vocab.json + merges.txt"
        vocab, merges = read_json(vocab_path), read_merges(merges_path.read_text(encoding="utf-8"))
        if tj is not None and (tj["model"]["vocab"] != vocab or _merges(tj) != merges):
            raise ValueError(f"{model_dir}: vocab.json/merges.txt and tokenizer.json hold different vocabularies")
    elif tj is not None:
        source = "tokenizer.json"
        vocab, merges = tj["model"]["vocab"], _merges(tj)
    else:
        return None
    specials = special_tokens(vocab, tj["added_tokens"] if tj else [], config)
    if source.startswith("vocab.json"):
        # GPT-2's own layout: tiktoken converts it. It keeps a copy of each file in its cache, keyed
        # by path; passing the files' hashes makes it re-read a file that has changed since.
        try:
            ranks = data_gym_to_mergeable_bpe_ranks(
                str(merges_path), str(vocab_path), _sha256(merges_path), _sha256(vocab_path)
            )
        except (AssertionError, KeyError):  # ids not in GPT-2's order (or not GPT-2's alphabet: checked below)
            ranks = ranks_from_vocab(vocab, merges, set(specials))
    else:
        ranks = ranks_from_vocab(vocab, merges, set(specials))
    _check_specials(ranks, specials, model_dir)
    return ranks, specials, source


def read_merges(text: str) -> Merges:
    """merges.txt: an optional "#version" line, then one "a b" pair per line."""
    lines = [ln for ln in text.split("\n") if ln]
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    return _pairs([ln.split(" ") for ln in lines])


def _pairs(merges: list) -> Merges:
    bad = [m for m in merges if len(m) != 2 or not all(m)]
    if bad:
        raise ValueError(f"a merge must be two tokens 'a b', got {bad[0]!r}")
    return [tuple(m) for m in merges]


def ranks_from_vocab(vocab: dict[str, int], merges: Merges, specials: set[str]) -> dict[bytes, int]:
    """Ranks = vocab ids, valid only if every merge makes a token with a larger id than the merge
    before it (id order = merge order) and every other token is one of the 256 bytes. (The bytes'
    own ranks never act as priorities: tiktoken only looks up the ranks of merged pairs.)"""
    dec = byte_decoder()
    missing = [b for c, b in dec.items() if c not in vocab]
    if missing:
        raise ValueError(f"the vocabulary lacks {len(missing)} of the 256 byte tokens (e.g. byte {missing[0]}); "
                         f"a byte-level BPE needs all of them")  # fmt: skip
    ranks = {bytes([b]): vocab[c] for c, b in dec.items()}
    last = -1
    for n, (a, b) in enumerate(merges, 1):
        token = a + b
        if token not in vocab or vocab[token] <= last:
            why = "is not in the vocabulary" if token not in vocab else f"has id {vocab[token]} <= {last}"
            raise ValueError(f"merge {n} ({a} {b}): the token it makes {why}; tiktoken needs ids in merge order")
        last = vocab[token]
        ranks[_to_bytes(token, dec)] = last
    made = set(dec) | {a + b for a, b in merges}
    extra = [t for t in vocab if t not in made and t not in specials]
    if extra:
        raise ValueError(f"tokens {extra[:3]} are neither bytes, merge results nor special tokens")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError("the vocabulary gives one id to several tokens")
    return ranks


def special_tokens(vocab: dict[str, int], added: list[dict], config: dict) -> dict[str, int]:
    """Added tokens, as transformers builds them: tokenizer.json's `added_tokens`, then the
    named ones from tokenizer_config.json (GPT-2's default: <|endoftext|> as bos/eos/unk).
    A name that is not there yet takes its vocab.json id, or the next free id."""
    specials: dict[str, int] = {}
    for t in added:
        flags = [f for f in ("lstrip", "rstrip", "single_word") if t.get(f)]
        if flags:
            raise ValueError(f"added token {t['content']!r} sets {flags}; only plain added tokens are supported")
        specials[t["content"]] = t["id"]
    for key in ("unk_token", "bos_token", "eos_token", "pad_token"):
        name = token_content(config.get(key, None if key == "pad_token" else EOT))
        if name is not None and name not in specials:
            top = max(specials.values(), default=-1)
            specials[name] = vocab[name] if name in vocab else (top + 1 if top >= len(vocab) else len(vocab))
    listed = {token_content(t): int(i) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        if not isinstance(extra, list):
            raise ValueError(f"tokenizer_config.json: {key} as a {type(extra).__name__} is not supported")
        listed.update({token_content(t): specials.get(token_content(t)) for t in extra})
    for name, i in listed.items():
        if name not in specials or (i is not None and specials[name] != i):
            raise ValueError(f"tokenizer_config.json lists the added token {name!r} (id {i}) but tokenizer.json "
                             f"does not have it with that id; add it to tokenizer.json's added_tokens")  # fmt: skip
    return specials


def is_gpt2_tokenizer_json(path: Path) -> bool:
    """Whether tokenizer.json is GPT-2's plain kind (what tiktoken runs; see `_read_tokenizer_json`). Any other
    kind (Llama 3, Qwen2, SentencePiece) is read by `FastTokenizer` instead."""
    try:
        _read_tokenizer_json(path)
    except ValueError:
        return False
    return True


# ---- reading and checking the files ----------------------------------------------------
def _read_tokenizer_json(path: Path) -> dict:
    """tokenizer.json, refused unless it is GPT-2's pipeline: no normalizer, ByteLevel split with
    GPT-2's regex and no prefix space, plain BPE, a post-processor that adds no tokens."""
    j = read_json(path)
    m, pre, post = j.get("model") or {}, j.get("pre_tokenizer") or {}, j.get("post_processor")
    checks = [
        (m.get("type") != "BPE", f"model.type={m.get('type')!r}"),
        (j.get("normalizer") is not None, "a normalizer"),
        (pre.get("type") != "ByteLevel", f"pre_tokenizer={pre.get('type')!r}"),
        (bool(pre.get("add_prefix_space")), "pre_tokenizer.add_prefix_space"),
        (pre.get("use_regex", True) is False, "pre_tokenizer.use_regex=false"),
        (bool(m.get("dropout")), "model.dropout"),
        (bool(m.get("byte_fallback")), "model.byte_fallback"),
        (bool(m.get("continuing_subword_prefix") or m.get("end_of_word_suffix")), "a subword prefix/suffix"),
        (post is not None and not _adds_nothing(post), "a post_processor that adds tokens"),
    ]
    problems = [what for bad, what in checks if bad]
    if problems:
        raise ValueError(f"{path} is not a GPT-2 byte-level BPE tokenizer: it has {', '.join(problems)}")
    j["added_tokens"] = j.get("added_tokens") or []
    return j


def _read_tokenizer_config(path: Path) -> dict:
    config = read_tokenizer_config(path.parent)
    for key in ("add_prefix_space", "add_bos_token", "add_eos_token"):
        if config.get(key):
            raise ValueError(f"{path}: {key}=true is not supported (it changes the token ids of every prompt)")
    return config


def _adds_nothing(post: dict) -> bool:
    if post.get("type") == "Sequence":
        return all(_adds_nothing(p) for p in post.get("processors", []))
    if post.get("type") == "TemplateProcessing":
        return [list(x) for x in post.get("single", [])] == [["Sequence"]]
    return post.get("type") == "ByteLevel"


def _merges(tj: dict) -> Merges:
    return _pairs([m.split(" ") if isinstance(m, str) else m for m in tj["model"].get("merges", [])])


def _check_specials(ranks: dict[bytes, int], specials: dict[str, int], model_dir: Path) -> None:
    by_id = {i: t for t, i in ranks.items()}
    for name, i in specials.items():
        if i in by_id and by_id[i] != name.encode():
            raise ValueError(f"{model_dir}: special token {name!r} has id {i}, which is also token {by_id[i]!r}")


def _to_bytes(token: str, dec: dict[str, int]) -> bytes:
    try:
        return bytes(dec[c] for c in token)
    except KeyError:
        raise ValueError(f"token {token!r} is not written in GPT-2's byte alphabet") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
