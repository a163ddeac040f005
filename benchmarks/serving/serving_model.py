"""A model to serve at a released checkpoint's shapes: random weights, and a real tokenizer as wide as its vocabulary.

    python benchmarks/serving/serving_model.py smollm2-135m      # prints .cache/random-models/smollm2-135m-serve

The serving benchmarks send text, so a server must tokenize prompts and detokenize what it streams back, with a
tokenizer that transformers (vLLM, transformers serve) and roseinfer both load. The offline benchmark's random
checkpoints (benchmarks/benchmark.py) carry only a placeholder tokenizer.tiktoken, whose tokens no BPE merge makes;
transformers cannot build a tokenizer.json from it. This module makes a directory that can:

    weights      benchmarks/benchmark.py's random checkpoint of that name (SmolLM2-135M: 30 layers, hidden 576,
                 9 query heads over 3 K/V heads, vocabulary 49,152), linked, not copied
    tokenizer    the bundled model's byte-level BPE (4,095 tokens + <|endoftext|> at 4,095, trained on
                 Shakespeare), widened to the checkpoint's vocabulary with merged tokens "a" + "Ġb": a word
                 piece joined to a piece that starts with a space. GPT-2's pre-tokenizer never puts a space
                 inside a piece, so these merges never fire on text: every text gets the bundled model's ids
                 (checked against both loaders), and every id the model samples decodes to text.
    config       the checkpoint's, with <|endoftext|> as BOS and EOS

So at these shapes a prompt is as many tokens as at the bundled model's, and the weights, the LM head and the K/V
per token are the real model's sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "roseinfer" / "models" / "tiny-shakespeare"
CACHE = REPO / ".cache" / "random-models"
EOT = "<|endoftext|>"


def widened_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], size: int) -> tuple[dict, list]:
    """`vocab` and `merges` grown to `size` ids with tokens a + b: a is a word piece, b is "Ġ" (a space) + a word."""
    vocab, merges = dict(vocab), list(merges)
    ordered = sorted(vocab, key=vocab.get)
    left = [t for t in ordered if t.isalpha()]  # "Ġ" is not alphabetic: no space inside
    right = [t for t in ordered if t.startswith("Ġ") and t[1:].isalpha()]
    pairs = ((a, b) for a in left for b in right if a + b not in vocab)
    while len(vocab) < size:
        a, b = next(pairs)
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    return vocab, merges


def write_tokenizer(out: Path, size: int) -> None:
    """tokenizer.json + tokenizer_config.json: the bundled BPE widened to `size` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = json.loads((BUNDLED / "vocab.json").read_text(encoding="utf-8"))
    lines = (BUNDLED / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]  # after "#version"
    vocab, merges = widened_bpe(vocab, [tuple(line.split(" ")) for line in lines if line], size)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def serving_model(name: str) -> Path:
    """The directory for `name` (one of benchmarks/benchmark.py's random shapes), made once under .cache/."""
    from benchmarks.benchmark import make_random_model

    out = CACHE / f"{name}-serve"
    if (out / "tokenizer.json").exists():
        return out
    weights = make_random_model(name, CACHE / name)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((weights / "config.json").read_text())
    eot = json.loads((BUNDLED / "vocab.json").read_text(encoding="utf-8"))[EOT]
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = eot
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}) + "\n")
    link = out / "model.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to((weights / "model.safetensors").resolve())
    write_tokenizer(out, config["vocab_size"])  # last: its file marks the directory complete
    return out


def model_dir(value: str) -> Path:
    """An argparse type: a directory as given, or a random shape's name turned into its serving directory."""
    if Path(value).is_dir():
        return Path(value)
    from benchmarks.benchmark import LLAMA_SHAPES, RANDOM_SHAPES

    if value in LLAMA_SHAPES or value in RANDOM_SHAPES:
        return serving_model(value)
    names = sorted({*LLAMA_SHAPES, *RANDOM_SHAPES})
    raise argparse.ArgumentTypeError(f"{value!r} is neither a directory nor one of {names}")


if __name__ == "__main__":
    print(serving_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m").relative_to(REPO))
