"""The float GEMM of stage 20's follow-up (csrc/dense_gemm.cpp) against oneDNN's packed linear, at SmolLM2-135M's
shapes (chapter 20, section 9.8).

    python benchmarks/engine/bench_dense_gemm.py --json results/20-fused-cpu-kernels/dense-gemm.json

One "sweep" calls, for each of the model's 30 layers, its four linears (qkv [960, 576], o [576, 576], gate_up
[3072, 576], down [576, 1536]) on x of N rows, as a decode or prefill step does, and then the LM head [49152, 576]
once. Two settings:
    cold   30 layers' own weights (random), 0.44 GB in fp32: each call's weight comes from memory, as in the engine
    warm   the first layer's weights for every layer (7 MB in bf16): they stay in the cache
Both GEMMs get the same weights (oneDNN's reordered with `_reorder_linear_weight`, ours with `pack_dense_weight`)
and take turns sweep by sweep. Each cell is GFLOP/s over the sweep (2 N x weights), the median of --repeat sweeps;
the ratio is dense / oneDNN. The outputs are checked equal to F.linear first (fp32: 1e-4; bf16: 2e-2 relative).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_model, git_version, write_json
from roseinfer.model_executor.dense_linear import dense_linear, dense_supported, pack_dense_weight

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)
HEAD = (49152, 576)


def onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def measure(rows: int, dtype: torch.dtype, cold: bool, repeat: int, weights) -> dict:
    xs = {name: torch.randn(rows, k).to(dtype) for name, (_, k) in [*SHAPES.items(), ("head", HEAD)]}
    calls = {
        "onednn": lambda x, w: onednn(x, w[0]),
        "dense": lambda x, w: dense_linear(x, w[1], None),
    }
    times = {k: [] for k in calls}
    for sweep in range(repeat + 1):  # the first sweep warms up and is dropped
        for kind in calls if sweep % 2 == 0 else reversed(list(calls)):
            call, t0 = calls[kind], time.perf_counter()
            for layer in range(LAYERS):
                for name in SHAPES:
                    call(xs[name], weights[name][layer if cold else 0])
            call(xs["head"], weights["head"][0])
            if sweep:
                times[kind].append(time.perf_counter() - t0)
    flops = 2 * rows * (LAYERS * sum(o * k for o, k in SHAPES.values()) + HEAD[0] * HEAD[1])
    rate = {kind: flops / statistics.median(t) / 1e9 for kind, t in times.items()}
    return {"rows": rows, "cold": cold, "onednn_gflops": rate["onednn"], "dense_gflops": rate["dense"],
            "ratio": rate["dense"] / rate["onednn"]}  # fmt: skip


def build_weights(dtype: torch.dtype, seed: int = 0) -> dict:
    """Per linear: [(oneDNN's packed, ours)] for each layer (the head: one), after checking both against F.linear."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (o, k) in [*SHAPES.items(), ("head", HEAD)]:
        out[name] = []
        for _ in range(1 if name == "head" else LAYERS):
            w = (torch.randn(o, k, generator=g) * 0.02).to(dtype)
            out[name].append((torch.ops.mkldnn._reorder_linear_weight(w), pack_dense_weight(w)))
        x = torch.randn(7, k, generator=g).to(dtype)
        want, tol = F.linear(x.float(), w.float()), 1e-4 if dtype == torch.float32 else 2e-2
        for got in (onednn(x, out[name][-1][0]), dense_linear(x, out[name][-1][1], None)):
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        if not dense_supported(torch.device("cpu"), dtype):
            print(f"{dtype_name}: the dense GEMM does not run on this CPU; skipped")
            continue
        weights = build_weights(dtype)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for cold in (True, False):
                for rows in args.rows:
                    r = measure(rows, dtype, cold, args.repeat, weights) | {"dtype": dtype_name, "threads": threads}
                    results.append(r)
                    print(f"{dtype_name:8} {threads} thread(s) {'cold' if cold else 'warm'} {rows:4} rows: oneDNN "
                          f"{r['onednn_gflops']:6.1f} GFLOP/s, dense {r['dense_gflops']:6.1f}  ({r['ratio']:.2f}x)",
                          flush=True)  # fmt: skip
    if args.json:
        meta = {"cpu": cpu_model(), "commit": git_version(), "torch": torch.__version__, "shapes": SHAPES,
                "head": HEAD, "layers": LAYERS, "repeat": args.repeat}  # fmt: skip
        write_json(args.json, {"meta": meta, "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
