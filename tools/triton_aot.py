"""Compile every Triton kernel of roseinfer ahead of time for real NVIDIA GPUs, with no GPU.

    python tools/triton_aot.py               # the table (about a minute the first time, cached after)
    python tools/triton_aot.py --json PATH   # also the numbers as JSON (the test reads them)
    python tools/triton_aot.py --ptx DIR     # also write each kernel's PTX
    python tools/triton_aot.py --block-size 8

`triton.compile` takes the kernel's Python source through Triton's passes and LLVM to PTX, then
runs the `ptxas` that ships with Triton to get a cubin for a `GPUTarget` (here sm_80, A100, and
sm_90, H100), exactly as a launch on that GPU would, minus the launch. So this proves the kernels
compile for those GPUs and shows what the compiler made of them: registers per thread, bytes
spilled to local memory, shared memory per program, and the widest global load in the PTX.

Next to that it prints the bytes each launch must read, and the time that takes at an H100's
3.35 TB/s and an A100's 2.0 TB/s (data-sheet HBM bandwidth): decode attention does one multiply-add
per byte or two it reads, so memory bandwidth, not arithmetic, bounds it (the decode roofline).

The kernels are listed once, next to them, in roseinfer/attention/triton_registry.py's KERNELS: one entry per
kernel with the arguments of a real launch at a given model shape. A new kernel in a file of its MODULES
(roseinfer/attention/triton_kernels.py, triton_prefill.py, triton_copy.py, roseinfer/model_executor/triton_ops.py)
gets an entry there; tests/test_08_triton_aot.py fails until it has one.
SHAPES are multi-head models; GQA_SHAPES grouped-query ones (fewer K/V heads than query heads), compiled
as well and reported apart (the JSON's `gqa_shapes` and `gqa_results`; `--gqa-only` compiles just those).
FP8_SHAPES are the kernels that touch the KV pools (FP8_KERNELS) with an fp8 KV cache (float8_e4m3fn pools,
kv_cache_dtype="fp8"), compiled for sm_90 only: Triton's fp8e4nv conversions need sm_89+ and it refuses them
for sm_80 (the JSON's `fp8_shapes`, `fp8_targets` and `fp8_results`).

Run it without TRITON_INTERPRET: under the interpreter Triton builds no compilable kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("triton_aot.py: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from roseinfer.attention.triton_registry import (  # noqa: E402  (the kernels: after the TRITON_INTERPRET check)
    COPY_PAIRS,
    FP8_KERNELS,
    FP8_SHAPES,
    FP8_TARGETS,
    GQA_SHAPES,
    KERNELS,
    MODULES,
    SHAPES,
    Shape,
    launched_kernels,
)

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}  # (backend, arch, warp size)
BANDWIDTH = {"H100": 3.35e12, "A100": 2.0e12}  # bytes/s, data sheets: H100 SXM, A100 80GB SXM


@dataclass
class Compiled:
    kernel: str
    shape: str
    target: str
    registers: int  # per thread
    local_bytes: int  # local memory per thread: register spills (and stack); 0 = no spill
    shared_bytes: int  # shared memory a launch gives each program
    widest_load: str  # the widest global load in the PTX, e.g. ld.global.v4.b32
    num_warps: int
    ptx_bytes: int
    cubin_bytes: int


def compile_kernel(name: str, shape: Shape, target: str, ptx_dir: Path | None = None) -> Compiled:
    fn = next(getattr(m, name) for m in MODULES if hasattr(m, name))
    args = KERNELS[name].args(shape)
    assert list(args) == fn.arg_names, f"{name}: KERNELS lists {list(args)}, the kernel takes {fn.arg_names}"
    signature = {n: t for n, (t, _) in args.items()}
    constexprs = {n: v for n, (t, v) in args.items() if t == "constexpr"}
    hints = {
        (i,): [["tt.divisibility", 16]]
        for i, (t, v) in enumerate(args.values())
        if t.startswith("*") or (t == "i32" and isinstance(v, int) and v % 16 == 0)
    }
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=hints)
    kernel = triton.compile(src, target=TARGETS[target])
    ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
    assert f".entry {name}" in ptx and cubin[:4] == b"\x7fELF", f"{name}: no PTX entry or no cubin"
    usage = resource_usage(cubin)
    loads = set(re.findall(r"\bld\.global[.\w:]*", ptx))  # e.g. ld.global.v4.b32: 4 lanes of 32 bits
    widest = max(loads, key=_load_bits, default="-")
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
        (ptx_dir / f"{name}.{shape.name}.{target}.ptx").write_text(ptx)
    return Compiled(
        name, shape.name, target, usage["REG"], usage["LOCAL"], kernel.metadata.shared, widest,
        kernel.metadata.num_warps, len(ptx), len(cubin),
    )  # fmt: skip


def _load_bits(instruction: str) -> int:
    lanes = re.search(r"\.v(\d)\.", instruction)
    bits = re.search(r"\.[bfsu](\d+)$", instruction)
    return (int(lanes.group(1)) if lanes else 1) * (int(bits.group(1)) if bits else 0)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL, SHARED ... of the cubin's kernel, from `cuobjdump -res-usage` (shipped with Triton)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", line)}


def compile_all(shapes: list[Shape] = SHAPES, ptx_dir: Path | None = None) -> list[Compiled]:
    return [compile_kernel(k, s, t, ptx_dir) for k in KERNELS for s in shapes for t in TARGETS]


def decode_roofline_rows() -> list[str]:
    """The shapes examples/verify_paged_attention.py times on a GPU, as bytes and memory-bound times."""
    H, D, bs, dtype_bytes = 16, 64, 16, 2  # gpt2-medium's attention, fp16
    rows = []
    for B, ctx in [(1, 8192), (8, 4096), (64, 1024), (256, 1024), (256, 2048)]:
        nbytes = 2 * B * ctx * H * D * dtype_bytes + 2 * B * H * D * dtype_bytes + B * (ctx // bs) * 4
        picks = []
        for sms in (132, 108):  # H100 SXM, A100: what paged_attention_auto launches on that many SMs
            split = sms > B * H and ctx >= 1024
            picks.append(f"S={min(16, -(-2 * sms // (B * H)), -(-ctx // 512))}" if split else "v1")
        times = [nbytes / bw * 1e6 for bw in BANDWIDTH.values()]
        cells = f"{B:>5} {ctx:>7} {nbytes / 1e6:>9.1f} {times[0]:>10.1f} {times[1]:>10.1f}"
        rows.append(f"{cells}   {picks[0]:>5} {picks[1]:>5}")
    return rows


def model_roofline() -> list[str]:
    """benchmark.py's decode roofline for the run scripts/gpu_check.sh makes, at H100 and A100 bandwidth."""
    import torch

    from benchmarks import benchmark

    argv = ["--workload", "gpu", "--model", "gpt2-medium", "--dtype", "float16", "--batch-size", "256"]
    args = benchmark.parse_args(argv)
    cfg = {"n_embd": 1024, "n_layer": 24, "vocab_size": 50257, "n_positions": 1024}  # gpt2-medium
    wl = benchmark.make_workload(args, cfg["n_positions"], cfg["vocab_size"], Path("."))
    rows = [f"benchmark.py {' '.join(argv)}: {sum(wl.output_lens):,} output tokens"]
    for gpu, bw in BANDWIDTH.items():
        r = benchmark.decode_roofline(wl, cfg, torch.float16, args.batch_size, bw)
        if not rows[1:]:
            rows.append(
                f"  at least {r['min_decode_steps']} decode steps x {r['weight_bytes'] / 1e6:.1f} MB of weights "
                f"= {r['min_decode_steps'] * r['weight_bytes'] / 1e9:.0f} GB, plus {r['kv_bytes'] / 1e12:.2f} TB "
                f"of K/V reads ({r['kv_bytes'] / (r['kv_bytes'] + r['min_decode_steps'] * r['weight_bytes']):.0%} "
                "of the bytes)"
            )
        rows.append(
            f"  {gpu} ({bw / 1e12:.2f} TB/s): >= {r['seconds']:.2f} s, <= {r['output_tokens_per_s']:,.0f} output tok/s"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the per-kernel numbers here")
    ap.add_argument("--ptx", type=Path, help="write each kernel's PTX into this folder")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    ap.add_argument("--gqa-only", action="store_true", help="compile the grouped-query shapes only (no table)")
    args = ap.parse_args()
    shapes = [dataclasses.replace(s, block_size=args.block_size) for s in SHAPES]
    gqa_shapes = [dataclasses.replace(s, block_size=args.block_size) for s in GQA_SHAPES]

    missing = launched_kernels() - set(KERNELS)
    if missing:
        print(f"kernels without an entry in KERNELS: {sorted(missing)}")
        return 1
    gqa_results = compile_all(gqa_shapes, args.ptx)
    if args.gqa_only:
        for r in gqa_results:
            print(f"{r.kernel:<30} {r.shape:<17} {r.target}  regs {r.registers:>3}  spill {r.local_bytes}")
        if args.json:
            report = {"gqa_shapes": [s.name for s in gqa_shapes], "gqa_results": [r.__dict__ for r in gqa_results]}
            args.json.write_text(json.dumps(report, indent=1))
        return 0
    results = compile_all(shapes, args.ptx)
    fp8_shapes = [dataclasses.replace(s, block_size=args.block_size) for s in FP8_SHAPES]
    fp8_results = [compile_kernel(k, s, t, args.ptx) for k in FP8_KERNELS for s in fp8_shapes for t in FP8_TARGETS]
    by_key = {(r.kernel, r.shape, r.target): r for r in [*results, *gqa_results]}

    n = len(results) + len(gqa_results) + len(fp8_results)
    print(f"Triton {triton.__version__}, no GPU: {n} compiles to PTX and cubin for {' and '.join(TARGETS)} "
          f"(fp8 pools: {' and '.join(FP8_TARGETS)}); fp16, block_size {args.block_size}, "
          f"num_warps {results[0].num_warps}")  # fmt: skip
    print("regs = registers per thread, spill = local memory per thread in bytes, smem = shared memory per program;")
    print("each launch: a decode step of 64 sequences at the model's full context (write: their 64 new tokens),")
    print("split-K with S = 4, prefill: 4 whole prompts of the model's context in one launch,")
    print(f"copy_blocks: {COPY_PAIRS} block copies in every layer's K and V (it writes as many bytes as it reads);")
    print("fused ops (RMSNorm with the residual, rotary, SiLU-and-mul): one layer's, for the 64 tokens of that step;")
    print("W8A8 (int8 quantization of x, the int8 GEMM + scales): the qkv projection of those 64 tokens;")
    print("MB = bytes it must read; µs = that read at the full HBM bandwidth")
    head = f"{'kernel':<30} {'shape':<17} {'regs':>7} {'spill':>5} {'smem':>11}  {'widest load':<17} {'grid':<12}"
    print(f"\n{'':<49}{'sm_80 / sm_90':^25}".rstrip())
    print(f"{head} {'MB':>7} {'µs H100':>8} {'µs A100':>8}")
    for k in KERNELS:
        for s in [*shapes, *gqa_shapes]:
            a, b = by_key[(k, s.name, "sm_80")], by_key[(k, s.name, "sm_90")]
            two = [f"{getattr(a, f)}/{getattr(b, f)}" if getattr(a, f) != getattr(b, f) else str(getattr(a, f))
                   for f in ("registers", "local_bytes", "shared_bytes")]  # fmt: skip
            load = a.widest_load if a.widest_load == b.widest_load else f"{a.widest_load}/{b.widest_load}"
            nbytes = KERNELS[k].bytes_read(s)
            grid = "(" + ", ".join(map(str, KERNELS[k].grid(s))) + ")"
            us = [nbytes / bw * 1e6 for bw in BANDWIDTH.values()]
            print(f"{k:<30} {s.name:<17} {two[0]:>7} {two[1]:>5} {two[2]:>11}  {load:<17} {grid:<12} "
                  f"{nbytes / 1e6:>7.2f} {us[0]:>8.2f} {us[1]:>8.2f}")  # fmt: skip

    print(f"\nfp8 KV cache (kv_cache_dtype='fp8', float8_e4m3fn pools), {' and '.join(FP8_TARGETS)} only: Triton's")
    print("fp8e4nv needs sm_89+ and refuses sm_80 (copy_blocks moves the bytes as uint8); same launches as above")
    print(f"{head} {'MB':>7} {'µs H100':>8}")
    for r in fp8_results:
        s = next(s for s in fp8_shapes if s.name == r.shape)
        nbytes, grid = KERNELS[r.kernel].bytes_read(s), "(" + ", ".join(map(str, KERNELS[r.kernel].grid(s))) + ")"
        us = nbytes / BANDWIDTH["H100"] * 1e6
        print(f"{r.kernel:<30} {r.shape:<17} {r.registers:>7} {r.local_bytes:>5} {r.shared_bytes:>11}  "
              f"{r.widest_load:<17} {grid:<12} {nbytes / 1e6:>7.2f} {us:>8.2f}")  # fmt: skip

    print("\ndecode attention roofline at gpt2-medium's shape (H 16, D 64, fp16, block 16), the shapes that")
    print("examples/verify_paged_attention.py times on a GPU; 'auto' = what paged_attention_auto launches there")
    print(f"{'B':>5} {'context':>7} {'MB read':>9} {'µs H100':>10} {'µs A100':>10}   {'auto on H100 / A100':>11}")
    for row in decode_roofline_rows():
        print(row)
    print("\nwhole-model decode roofline (weights once per step, every token's context K/V once; prefill ignored):")
    for row in model_roofline():
        print(row)
    if args.json:
        report = {"launched": sorted(launched_kernels()), "targets": list(TARGETS), "shapes": [s.name for s in shapes]}
        gqa = {"gqa_shapes": [s.name for s in gqa_shapes], "gqa_results": [r.__dict__ for r in gqa_results]}
        fp8 = {"fp8_shapes": [s.name for s in fp8_shapes], "fp8_targets": FP8_TARGETS,
               "fp8_kernels": FP8_KERNELS, "fp8_results": [r.__dict__ for r in fp8_results]}  # fmt: skip
        report = {**report, "results": [r.__dict__ for r in results], **gqa, **fp8}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
