"""The Llama layer's element-wise ops, one at a time: PyTorch reference vs fused C++ kernel vs torch.compile.

    python benchmarks/engine/bench_fused_ops.py --threads 1 2 --out results/fused_ops.json

At SmolLM2-135M's shapes (hidden 576, H = 9, Hkv = 3, D = 64, intermediate 1536) for N rows (a decode step's
batch: 1, 32, 256; a prefill chunk: 2048), each op is called the way LlamaForCausalLM calls it:

    rms_norm            RMSNorm(x)                      x [N, 576]                         (the first layer)
    fused_add_rms_norm  RMSNorm(x, residual)            x, residual [N, 576]               (every other norm)
    rotary              ApplyRotary(q, k, cos, sin)     q [N, 9, 64], k [N, 3, 64] views of qkv [N, 960]
    silu_and_mul        SiluAndMul(x)                   x [N, 3072] -> [N, 1536]
    rotary+write_kv     the rotation, then K and V into their KV slots (write_kv_flat); `fused_write` is the
                        one kernel that does both (torch.ops.roseinfer.rotary_embedding_write_kv)

    native    the CustomOp's forward_native (PyTorch ops)
    fused     its forward_cpu (the C++ op, Python wrapper included: what the model pays)
    compile   torch.compile(forward_native, dynamic=True), as custom_ops="compile" runs it; the first calls'
              compile time is reported apart (`compile_s`, per op and N: N = 1 compiles a graph of its own, the
              next N the dynamic one, the rest reuse it), not in the per-call time; inductor's caches are off
              unless --warm-compile-cache

A time is the median over `--repeats` batches of the mean per-call time in a batch of calls (each batch about
20 ms). On a shared machine the numbers move between runs by 10-30%: compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from benchmarks.benchmark import device_name
from benchmarks.common import git_version
from roseinfer import custom_ops
from roseinfer.attention.sdpa import write_kv_flat
from roseinfer.model_executor.activations import SiluAndMul
from roseinfer.model_executor.layernorm import RMSNorm
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding

C, H, HKV, D, INTER, EPS = 576, 9, 3, 64, 1536, 1e-5  # SmolLM2-135M
BLOCK = 16
OPS = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "rotary+write_kv")


def per_call_us(fn: Callable[[], object], repeats: int) -> float:
    """Median over `repeats` batches of the mean microseconds per call; each batch runs about 20 ms."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.02:
        fn()
        n += 1
    batches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(batches)


class Ops:
    """The modules, built once (their shapes do not depend on N), and their compiled forward_native."""

    def __init__(self, dtype: torch.dtype):
        self.norm, self.rope, self.act = RMSNorm(C, EPS).to(dtype), ApplyRotary(is_neox=True), SiluAndMul()
        self.compiled: dict[str, Callable] = {}

    def module(self, op: str) -> torch.nn.Module:
        return {"rms_norm": self.norm, "fused_add_rms_norm": self.norm, "silu_and_mul": self.act}.get(op, self.rope)

    def impl(self, op: str, name: str) -> Callable:
        m = self.module(op)
        if name == "native":
            return m.forward_native
        if name == "fused":
            return m.forward_cpu
        if op not in self.compiled:  # one compiled function per op, reused for every N (dynamic shapes)
            self.compiled[op] = torch.compile(m.forward_native, dynamic=True)
        return self.compiled[op]


def inputs(n: int, dtype: torch.dtype) -> dict:
    """op name -> run(f): calls the implementation f on fresh inputs of n rows, as the model calls it."""
    g = torch.Generator().manual_seed(n)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    x, res = rand(n, C), rand(n, C)  # [N, C]
    qkv = rand(n, (H + 2 * HKV) * D)  # [N, (H + 2 Hkv) D]
    q, k, v = (t.view(n, -1, D) for t in qkv.split([H * D, HKV * D, HKV * D], dim=-1))  # [N, H | Hkv, D] views
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.arange(n) + 100, dtype)  # [N, 1, D]
    gate_up = rand(n, 2 * INTER)  # [N, 2I]
    blocks = -(-max(n, 1) // BLOCK) + 1
    k_cache, v_cache = torch.zeros(2, blocks, BLOCK, HKV, D, dtype=dtype).unbind(0)  # [blocks, BLOCK, Hkv, D]
    slots = torch.randperm(blocks * BLOCK, generator=g)[:n]  # [N]
    return {
        "rows": n,
        "rms_norm": lambda f: f(x),
        "fused_add_rms_norm": lambda f: f(x, res),
        "rotary": lambda f: f(q, k, cos, sin),
        "silu_and_mul": lambda f: f(gate_up),
        "rotary+write_kv": lambda f: write_kv_flat(f(q, k, cos, sin)[1], v, k_cache, v_cache, slots),
        "fused_write": lambda f: torch.ops.roseinfer.rotary_embedding_write_kv(
            q, k, v, cos, sin, k_cache, v_cache, slots, True
        ),  # fmt: skip
    }


def measure(ops: Ops, runs: dict, op: str, impls: list[str], repeats: int, compile_s: dict) -> dict[str, float]:
    """impl name -> microseconds per call of `op` on `runs`' inputs; the compile column's first call (the
    compilation, when one happens for this N) is timed into compile_s[(op, N)] instead."""
    out = {}
    for name in impls:
        f = ops.impl(op, name)
        if name == "compile":
            t0 = time.perf_counter()
            runs[op](f)
            compile_s[(op, runs["rows"])] = time.perf_counter() - t0
        out[name] = per_call_us(lambda: runs[op](f), repeats)  # noqa: B023 (called before f changes)
    if op == "rotary+write_kv":
        out["fused_write"] = per_call_us(lambda: runs["fused_write"](None), repeats)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 2048], help="N, the rows of a step")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7, help="timed batches per cell (the median is reported)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument(
        "--warm-compile-cache",
        action="store_true",
        help="let torch.compile reuse inductor's on-disk cache (compile_s then measures a cache hit)",
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not custom_ops.available():
        raise SystemExit("the C++ extension could not be built: there is no fused column to measure")
    dtype = getattr(torch, args.dtype)
    if not args.warm_compile_cache:
        inductor_config.force_disable_caches = True  # compile_s: a first compile, not a cache hit
    impls = ["native", "fused"] + ([] if args.no_compile else ["compile"])
    ops, rows, compile_s = Ops(dtype), [], {}  # compile_s: (op, N) -> seconds of the first compiled call
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for n in args.rows:
                runs = inputs(n, dtype)
                for op in OPS:
                    row = {"op": op, "rows": n, "threads": threads, **measure(ops, runs, op, impls, args.repeats,
                                                                             compile_s)}  # fmt: skip
                    rows.append(row)
                    cells = "  ".join(f"{k} {row[k]:8.1f}" for k in impls + ["fused_write"] if k in row)
                    gain = row["native"] / row["fused"]
                    print(f"{op:>19} N={n:<5} t={threads}  {cells}  us   native/fused {gain:.2f}x", flush=True)
    result = {
        "benchmark": "bench_fused_ops",
        "shapes": dict(hidden=C, heads=H, kv_heads=HKV, head_dim=D, intermediate=INTER, dtype=args.dtype),
        "machine": dict(cpu=device_name(torch.device("cpu")).split(" (")[0], torch=torch.__version__),
        "compile_cache": "warm" if args.warm_compile_cache else "cold (torch._inductor caches disabled)",
        "git": git_version(),
        "unit": "microseconds per call (median of batches)",
        "results": rows,
        "compile_s": [dict(op=op, rows=n, seconds=s) for (op, n), s in compile_s.items()],
        "note": "measured on a shared machine with 2 cores: other work moves these numbers by 10-30%",
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
