"""Per-token latency of naive decode vs sequence length (chapter 01's plot).

Naive decode re-runs the model over the whole sequence for every new token, so the
time per token grows with the length. We time one forward at each length, the way the
naive loop would call it, and plot it. The naive loop itself is chapter 01's code (its stage tag);
the model's dense forward `GPT2.forward(input_ids [1, T])` it called is still in
roseinfer/model_executor/gpt2.py, and that is what is timed.

    python benchmarks/engine/measure_naive_latency.py --out chapters/01-naive-decode/naive_latency.png
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from roseinfer import DEFAULT_MODEL
from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir


def time_forward(model, T: int, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    with torch.inference_mode():
        model(ids)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default="chapters/01-naive-decode/naive_latency.png")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model_dir(args.model)
    cfg = read_model_config(path)
    model = load_model(path, cfg, torch.device("cpu"), torch.float32)  # GPT2.forward: no KV cache
    n_ctx = cfg.n_positions
    lengths = [1, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, n_ctx - 1]
    ms = [1000 * time_forward(model, T, args.repeats) for T in lengths]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {os.path.relpath(args.model)}")
    print(f"{'sequence length':>16} {'ms per new token':>17}")
    for T, m in zip(lengths, ms, strict=True):
        print(f"{T:>16} {m:>17.2f}")
    total = sum(1000 * time_forward(model, T, 1) for T in range(1, n_ctx, 32)) * 32 / 1000
    print(f"estimated time to generate {n_ctx - 1} tokens from a 1-token prompt: {total:.1f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(lengths, ms, "o-", color="#b5172b")
    ax.set_xlabel("sequence length (tokens already in the context)")
    ax.set_ylabel("ms to produce the next token")
    ax.set_title("Naive decode: every token re-reads the whole sequence")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
