"""The CPU attention backend's kernels, old against new, at SmolLM2-135M's shapes (chapter 20).

    python benchmarks/engine/bench_attention.py --out results/20-.../attention.json

Both sides are the cpu backend's `forward` for one layer (AttentionMetadata as the model runner builds it, the
step's plan made once, outside the timing, as every layer reuses it):

    old   roseinfer/attention/sdpa.py and roseinfer/csrc/paged_attention.cpp at --old-rev (stage 19's kernel,
          a (token, head) score at a time, parallel over sequences), the C++ built under the op namespace
          roseinfer_old, so both live in one process
    new   the working tree's backend (`get_backend("cpu")`)

With `--kv-cache-dtype fp8` (chapter 22) both sides are the working tree's backend: old on --dtype pools, new on
float8_e4m3fn pools holding the same values (so the outputs are equal), i.e. what an fp8 KV cache saves.

Cases, H=9 query heads, Hkv=3 K/V heads, D=64, block size 16, every sequence with the same length:
    decode    B sequences of ctx tokens each (B in --batches, ctx in --ctx)
    prefill   one chunk of T new tokens after ctx cached ones (T in --chunks, ctx in --chunk-ctx; ctx 0 = a first
              chunk, which attends only to its own fresh K/V)

Each case cycles through as many layers' pools as the model has (30) or as fit in --pool-mib, so the K/V of one
call is not still in the cache from the call before, as in a real step. The table gives the median over --repeat
sweeps of the time per layer call, and GB/s of K/V read: sum over sequences of seq_len x Hkv x D x 2 (K and V)
x dtype bytes, divided by that time. Timings on a shared machine are noisy: compare medians taken in one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks.common import git, git_version
from roseinfer import custom_ops
from roseinfer.attention import AttentionMetadata, get_backend
from roseinfer.attention.sdpa import write_kv_flat

H, HKV, D, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
LAYERS = 30


@functools.cache
def old_backend(rev: str):
    """(forward, prepare) of the cpu backend at `rev`: its sdpa.py as a module, its kernel as roseinfer_old."""
    from torch.utils.cpp_extension import load_inline

    src = git("show", f"{rev}:roseinfer/csrc/paged_attention.cpp")
    src = src.replace("TORCH_LIBRARY_FRAGMENT(roseinfer,", "TORCH_LIBRARY(roseinfer_old,")
    src = src.replace("TORCH_LIBRARY_IMPL(roseinfer,", "TORCH_LIBRARY_IMPL(roseinfer_old,")
    with tempfile.TemporaryDirectory(prefix="roseinfer_old_csrc_") as headers:  # the headers it includes, at rev
        for name in git("ls-tree", "--name-only", f"{rev}:roseinfer/csrc").split():
            if name.endswith(".h"):
                (Path(headers) / name).write_text(git("show", f"{rev}:roseinfer/csrc/{name}"))
        load_inline(name=f"roseinfer_old_attention_{rev}", cpp_sources=[src], extra_cflags=custom_ops.CFLAGS,
                    extra_include_paths=[headers], is_python_module=False, verbose=False)  # fmt: skip
    sdpa = sys.modules["roseinfer_old_sdpa"] = types.ModuleType("roseinfer_old_sdpa")  # (dataclasses look it up)
    exec(compile(git("show", f"{rev}:roseinfer/attention/sdpa.py"), f"{rev}:sdpa.py", "exec"), sdpa.__dict__)

    def decode(q, k_cache, v_cache, tables, lens, scale):
        return torch.ops.roseinfer_old.paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, scale)

    forward = functools.partial(sdpa.attention_sdpa, decode_kernel=decode)
    return forward, functools.partial(sdpa.plan_sdpa, gather_decodes=False)


def make_case(B: int, ctx: int, T: int, dtype: torch.dtype, pool_bytes: int, seed: int = 0,
              pool_dtype: torch.dtype | None = None):  # fmt: skip
    """B requests of ctx cached tokens and T new ones each; (q, key, value, [(k_cache, v_cache)] per layer, meta).
    `pool_dtype`: the pools' dtype when it is not the queries' (float8_e4m3fn: kv_cache_dtype="fp8")."""
    g = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or dtype
    seq_len = ctx + T
    width = math.ceil(seq_len / BLOCK)
    per_layer = 2 * B * width * BLOCK * HKV * D * pool_dtype.itemsize
    layers = max(1, min(LAYERS, pool_bytes // per_layer))
    pools = [(torch.randn(B * width, BLOCK, HKV, D, generator=g).to(pool_dtype),
              torch.randn(B * width, BLOCK, HKV, D, generator=g).to(pool_dtype)) for _ in range(layers)]  # fmt: skip
    tables = torch.randperm(B * width, generator=g).view(B, width).int()  # scrambled blocks
    pos = torch.arange(ctx, seq_len)
    slots = torch.cat([tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK for b in range(B)])
    starts = [b * T for b in range(B + 1)]
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.full((B,), seq_len, dtype=torch.int32), block_tables=tables, num_decodes=B if T == 1 else 0,
        max_query_len=T, query_start_loc_cpu=starts, seq_lens_cpu=[seq_len] * B,
    )  # fmt: skip
    q = torch.randn(B * T, H, D, generator=g).to(dtype)
    key, value = torch.randn(B * T, HKV, D, generator=g).to(dtype), torch.randn(B * T, HKV, D, generator=g).to(dtype)
    for k_cache, v_cache in pools:  # the new tokens' K/V in the pool, as the layer writes them before attention
        write_kv_flat(key, value, k_cache, v_cache, slots)
    return q, key, value, pools, meta


def as_float_pools(case, dtype: torch.dtype):
    """The same case with every pool converted to `dtype` (fp8 values are exact in fp32 and bf16)."""
    q, key, value, pools, meta = case
    return q, key, value, [(k.to(dtype), v.to(dtype)) for k, v in pools], meta


def time_forward(forward, prepare, case, repeat: int) -> float:
    """Median seconds per layer call: each sweep calls every layer's pool once."""
    q, key, value, pools, meta = case
    meta.plan = prepare(meta, BLOCK)
    scale = D**-0.5
    for k_cache, v_cache in pools[:2]:  # warm-up
        forward(q, key, value, k_cache, v_cache, meta, scale)
    sweeps = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for k_cache, v_cache in pools:
            forward(q, key, value, k_cache, v_cache, meta, scale)
        sweeps.append((time.perf_counter() - t0) / len(pools))
    return statistics.median(sweeps)


def check_equal(old, new, cases) -> float:
    """The largest difference between the two outputs on the case's first layer (a sanity check)."""
    outs = []
    for (forward, prepare), (q, key, value, pools, meta) in zip((old, new), cases, strict=True):
        meta.plan = prepare(meta, BLOCK)
        outs.append(forward(q, key, value, *pools[0], meta, D**-0.5).float())
    return float((outs[0] - outs[1]).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--old-rev", default="4c3b345", help="the commit whose kernel and sdpa.py are 'old'")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--chunk-ctx", type=int, nargs="+", default=[0, 512, 2048])
    ap.add_argument("--repeat", type=int, default=7, help="timed sweeps per case (the median is reported)")
    ap.add_argument("--pool-mib", type=int, default=1024, help="K/V pools cycled through per case, at most")
    ap.add_argument("--only", choices=["decode", "prefill"], help="one kind of case only")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="fp8: 'new' is the backend on fp8 pools, 'old' the same backend on --dtype pools holding "
                         "the same values (what an fp8 cache saves), instead of --old-rev's kernel")  # fmt: skip
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    fp8 = args.kv_cache_dtype == "fp8"
    if not custom_ops.available():
        print("the C++ extension does not build here", file=sys.stderr)
        return 1
    backend = get_backend("cpu", "cpu")
    new = (backend.forward, backend.prepare)
    old = new if fp8 else old_backend(args.old_rev)
    cases = [("decode", B, ctx, 1) for B in args.batches for ctx in args.ctx] if args.only != "prefill" else []
    cases += [("prefill", 1, ctx, T) for T in args.chunks for ctx in args.chunk_ctx] if args.only != "decode" else []
    rows = []
    print(f"{'case':8} {'B':>3} {'ctx':>5} {'T':>4} {'thr':>3} {'old ms':>8} {'new ms':>8} {'x':>6} "
          f"{'old GB/s':>9} {'new GB/s':>9} {'max|diff|':>9}")  # fmt: skip
    for kind, B, ctx, T in cases:
        case = make_case(B, ctx, T, dtype, args.pool_mib * 2**20, pool_dtype=torch.float8_e4m3fn if fp8 else None)
        old_case = as_float_pools(case, dtype) if fp8 else case
        kv_bytes = B * (ctx + T) * HKV * D * 2  # elements of K and V read
        old_bytes, new_bytes = kv_bytes * dtype.itemsize, kv_bytes * (1 if fp8 else dtype.itemsize)
        diff = check_equal(old, new, (old_case, case))
        for threads in args.threads:
            torch.set_num_threads(threads)
            t_old, t_new = (time_forward(*side, c, args.repeat) for side, c in ((old, old_case), (new, case)))
            row = dict(case=kind, B=B, ctx=ctx, T=T, threads=threads, old_ms=t_old * 1e3, new_ms=t_new * 1e3,
                       old_gbps=old_bytes / t_old / 1e9, new_gbps=new_bytes / t_new / 1e9, max_diff=diff)  # fmt: skip
            rows.append(row)
            print(f"{kind:8} {B:3} {ctx:5} {T:4} {threads:3} {row['old_ms']:8.3f} {row['new_ms']:8.3f} "
                  f"{t_old / t_new:6.2f} {row['old_gbps']:9.2f} {row['new_gbps']:9.2f} {diff:9.1e}",
                  flush=True)  # fmt: skip
        del case, old_case
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(old_rev=None if fp8 else args.old_rev, new_rev=git_version(), dtype=args.dtype,
                    kv_cache_dtype=args.kv_cache_dtype, repeat=args.repeat,
                    shapes=dict(H=H, Hkv=HKV, D=D, block_size=BLOCK), torch=torch.__version__)  # fmt: skip
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
