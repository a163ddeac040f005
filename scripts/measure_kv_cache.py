"""Naive decode vs KV-cache decode: output tokens/s at 64, 256 and 512 new tokens.

    python scripts/measure_kv_cache.py

Both engines decode greedily from the same 1-token prompt with ignore_eos, so they do
exactly the same number of steps. The context is 512 tokens, so "512" means 511 new
tokens after the 1-token prompt.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from roseinfer import DEFAULT_MODEL, InferenceEngine, SamplingParams


def tokens_per_s(engine: InferenceEngine, n: int, repeats: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        count = sum(1 for _ in engine.token_stream([engine.eos_token_id], params))
        best = min(best, time.perf_counter() - t0)
    return count, count / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs")
    args = ap.parse_args()
    naive = InferenceEngine(args.model, device=args.device, use_kv_cache=False)
    cached = InferenceEngine(args.model, device=args.device, use_kv_cache=True)
    model = os.path.relpath(args.model)
    print(f"model {model}, device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'new tokens':>10} {'naive tok/s':>12} {'KV cache tok/s':>15} {'speedup':>8}")
    for n in (64, 256, 512):
        count, a = tokens_per_s(naive, n, args.repeats)
        _, b = tokens_per_s(cached, n, args.repeats)
        print(f"{count:>10} {a:>12.1f} {b:>15.1f} {b / a:>7.2f}x")


if __name__ == "__main__":
    main()
