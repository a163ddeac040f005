"""W8A8 int8 linear layers against fp32 at SmolLM2-135M's shapes, on this CPU.

    python benchmarks/engine/bench_int8_linear.py [--threads 1] [--rows 1 32 64 128 256]

Per layer shape (SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536) and row count, the
median time of: fp32 through oneDNN's packed weight (what the engine runs for float checkpoints), fp32
through F.linear (MKL), the W8A8 reference (int8.py: int64 matmul), the W8A8 fast path as Int8Linear runs it
(int8_linear.py: per-token quantization, then int8_gemm on the weight packed at load time), the same without the
packed weight (every row count on torch._int_mm + the one-pass epilogue: the path at stage 22's tag, but for the
epilogue), and torch._int_mm alone (the integer GEMM
without the quantization of x and the epilogue). Ratios are against fp32 oneDNN, measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import median_seconds
from roseinfer.model_executor.onednn_linear import pack_weight, packed_linear
from roseinfer.model_executor.quantization.int8 import quantize_weight, scaled_int8_quant, w8a8_linear_reference
from roseinfer.model_executor.quantization.int8_linear import pack_int8_weight, vnni_gemm_available, w8a8_linear

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}


def median_us(fn, repeat: int) -> float:
    return median_seconds(fn, repeat, warmup=3) * 1e6


def measure(x, w, packed, w_q, w_s, w_t, vnni, repeat: int) -> dict[str, float]:
    """Median µs of each way to compute x Wᵀ for one x [rows, K]."""
    x_q, _ = scaled_int8_quant(x)
    return dict(
        onednn=median_us(lambda: packed_linear(x, packed, None), repeat),
        aten=median_us(lambda: F.linear(x, w), repeat),
        ref=median_us(lambda: w8a8_linear_reference(x, w_q, w_s), max(5, repeat // 10)),
        fast=median_us(lambda: w8a8_linear(x, w_t, w_s, None, None, vnni), repeat),
        no_vnni=median_us(lambda: w8a8_linear(x, w_t, w_s), repeat),
        int_mm=median_us(lambda: torch._int_mm(x_q, w_t), repeat),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 48, 64, 128, 256])
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s); median µs per call; ×: fp32 oneDNN / this")
    print(f"vnni int8_gemm: {vnni_gemm_available()}; 'no vnni': the fast path on torch._int_mm at every row count")
    print(f"{'layer':<13}{'rows':>5}{'fp32 onednn':>12}{'fp32 aten':>10}{'w8a8 ref':>10}{'w8a8 fast':>10}"
          f"{'no vnni':>9}{'_int_mm':>9}{'fast ×':>8}")  # fmt: skip
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        packed, (w_q, w_s) = pack_weight(w), quantize_weight(w)
        w_t = w_q.t()  # [K, N], a view, as Int8Linear holds it
        vnni = pack_int8_weight(w_q) if vnni_gemm_available() else None
        for rows in args.rows:
            t = measure(torch.randn(rows, k), w, packed, w_q, w_s, w_t, vnni, args.repeat)
            print(f"{name:<13}{rows:>5}{t['onednn']:>12.1f}{t['aten']:>10.1f}{t['ref']:>10.1f}{t['fast']:>10.1f}"
                  f"{t['no_vnni']:>9.1f}{t['int_mm']:>9.1f}{t['onednn'] / t['fast']:>7.2f}×")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
