"""Write GPT-2's tokenizer files (vocab.json + merges.txt) next to a `tokenizer.tiktoken`.

    python tools/models/export_hf_tokenizer.py [MODEL_DIR]      # default: the bundled model

so that `transformers.AutoTokenizer.from_pretrained(MODEL_DIR)` loads the directory like any
GPT-2 on the Hub. Tokens are written in GPT-2's printable alphabet (byte 0x20 is "Ġ"), ids
are the tiktoken ranks, and <|endoftext|> takes the last id, as in GPT-2's own vocab.json.

merges.txt needs, for every multi-byte token, the pair of tokens that BPE joins to make it.
A rank is the order in which merges were learned, so that pair is what BPE gives for the
token's bytes when only the merges learned before it may be used. The script then checks
its output: tiktoken's own converter accepts the files, and tiktoken, our Tokenizer and
transformers give the same ids on every chapter's text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from roseinfer.model_executor.loader import DEFAULT_MODEL
from roseinfer.tokenizer import Tokenizer
from roseinfer.tokenizer.hf_tokenizer import EOT, byte_decoder
from roseinfer.tokenizer.tokenizer import read_tiktoken_file

REPO = Path(__file__).resolve().parents[2]


def last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE joins last to make `token`, using only merges ranked before it."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        rank, i = min((ranks.get(parts[i] + parts[i + 1], len(ranks)), i) for i in range(len(parts) - 1))
        if rank >= ranks[token]:
            raise ValueError(f"BPE cannot build {token!r} from earlier merges")
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def export(model_dir: Path) -> None:
    ranks = read_tiktoken_file(model_dir / "tokenizer.tiktoken")
    encode = {b: c for c, b in byte_decoder().items()}  # byte -> GPT-2's printable character
    text = lambda token: "".join(encode[b] for b in token)
    vocab = {text(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab[EOT] = len(ranks)
    merges = [last_merge(t, ranks) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1]
    (model_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{text(a)} {text(b)}" for a, b in merges]
    (model_dir / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {model_dir / 'vocab.json'} ({len(vocab)} tokens) and merges.txt ({len(merges)} merges)")
    check(model_dir)


def check(model_dir: Path) -> None:
    """tiktoken (tokenizer.tiktoken), our Tokenizer on vocab.json + merges.txt, and transformers agree."""
    import os
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken would keep a copy of the temporary files
    with tempfile.TemporaryDirectory() as tmp:  # the directory without tokenizer.tiktoken
        for name in ("config.json", "vocab.json", "merges.txt"):
            shutil.copy(model_dir / name, Path(tmp) / name)
        from_files = Tokenizer.from_model_dir(Path(tmp))
        assert from_files.source == "vocab.json + merges.txt", from_files.source
        hf = AutoTokenizer.from_pretrained(tmp)
    ours = Tokenizer.from_model_dir(model_dir)
    texts = [p.read_text(encoding="utf-8") for p in sorted(REPO.glob("chapters/*/README.md"))]
    texts += ["<|endoftext|> inside a prompt", "  two spaces, digits 12345, 🌹 and 你好\r\n"]
    for t in texts:
        assert ours.encode(t) == from_files.encode(t) == hf(t)["input_ids"], t[:60]
    print(f"checked: tokenizer.tiktoken, vocab.json + merges.txt and transformers agree on {len(texts)} texts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default=DEFAULT_MODEL)
    export(Path(ap.parse_args().model_dir))


if __name__ == "__main__":
    main()
