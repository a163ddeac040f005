"""The bitmask on a step's logits: the PyTorch reference, the C++ op and xgrammar's own CPU kernel.

    python benchmarks/structured/bench_bitmask.py [--threads 2] [--rows 32]

For a vocabulary of 49,152 tokens (SmolLM2, GPT-2 size) and 128,256 (Llama 3), `--rows` rows of float32 logits
and two kinds of bitmask rows: `random` (every word a mix of allowed and forbidden tokens: the worst case for the
C++ op, which skips whole allowed words) and `string` (inside a JSON string: every word allowed but a few, the
usual case). Each function is timed as the runner calls it, in place on the same logits, median of 50 calls
after 5 warm-up calls; all three are checked equal first.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import median_seconds
from roseinfer.sample.grammar_bitmask import apply_token_bitmask, apply_token_bitmask_reference


def median_ms(fn, calls: int = 50) -> float:
    return median_seconds(fn, calls, warmup=5) * 1e3


def masks(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    if kind == "random":
        return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    mask = torch.full((rows, words), -1, dtype=torch.int32)
    forbidden = torch.randint(0, words, (rows, 8), generator=g)  # a quote, a backslash, control characters ...
    return mask.scatter_(1, forbidden, 0x7FFFFFFE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    rows = list(range(args.rows))
    print(f"torch threads: {args.threads}, {args.rows} rows, float32 logits, ms per call (median of 50)")
    print(f"{'vocabulary':>10} {'mask':>7} {'reference':>10} {'C++ op':>8} {'xgrammar':>9} {'ref / C++':>10}")
    for vocab in (49152, 128256):
        for kind in ("random", "string"):
            mask = masks(kind, args.rows, vocab, g)
            logits = torch.randn(args.rows, vocab, generator=g)
            want = apply_token_bitmask_reference(logits.clone(), mask)
            got, xg = logits.clone(), logits.clone()
            apply_token_bitmask(got, mask, rows)
            xgr.apply_token_bitmask_inplace(xg, mask, backend="cpu")
            assert torch.equal(got, want) and torch.equal(xg, want), "the three disagree"
            ref = median_ms(lambda x=logits, m=mask: apply_token_bitmask_reference(x, m))
            op = median_ms(lambda x=logits, m=mask: apply_token_bitmask(x, m, rows))
            xk = median_ms(lambda x=logits, m=mask: xgr.apply_token_bitmask_inplace(x, m, backend="cpu"))
            print(f"{vocab:>10} {kind:>7} {ref:>10.3f} {op:>8.3f} {xk:>9.3f} {ref / op:>9.0f}x")


if __name__ == "__main__":
    main()
