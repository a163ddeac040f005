"""Stage 15: what tensor parallelism costs and buys, measured here and worked out on paper.

    python benchmarks/engine/measure_tensor_parallel.py                      # all three parts
    python benchmarks/engine/measure_tensor_parallel.py --parts allreduce paper
    python benchmarks/engine/measure_tensor_parallel.py --parts engine --repeats 3 --num-requests 16

1. allreduce: the latency of one gloo all-reduce between 2 processes on this machine, for the sizes a
   gpt2-medium step sends (T tokens × n_embd 1024 × fp32), median of many.
2. engine: random weights in gpt2-medium's shapes (scripts/benchmark.py --model gpt2-medium), the same
   greedy workload with tensor_parallel_size 1 and 2, one torch thread per rank; output tokens/s, and on
   rank 0 the share of step time spent in all-reduces and in the step broadcast.
3. paper: the step time of GPT-2 XL and a 7B model on 2 / 4 / 8 GPUs over NVLink and across nodes over
   InfiniBand, from weight bytes, FLOPs and a latency + bandwidth model of each all-reduce.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

GPT2_MEDIUM = dict(n_embd=1024, n_layer=24, n_head=16)


# ---- 1. gloo all-reduce latency ---------------------------------------------------------------------------
def _allreduce_rank(rank: int, port: int, sizes: list[int], iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    _allreduce_loop(sizes, iters)
    dist.destroy_process_group()


def _allreduce_loop(sizes: list[int], iters: int) -> dict[int, float]:
    import torch.distributed as dist

    medians = {}
    for numel in sizes:
        t = torch.ones(numel)
        for _ in range(10):  # warm-up
            dist.all_reduce(t)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        medians[numel] = statistics.median(times)
    return medians


def measure_allreduce(tokens: list[int], iters: int) -> dict[int, float]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    sizes = [t * GPT2_MEDIUM["n_embd"] for t in tokens]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)  # fmt: skip
    proc = mp.get_context("spawn").Process(target=_allreduce_rank, args=(1, store.port, sizes, iters, None))
    proc.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    medians = _allreduce_loop(sizes, iters)
    dist.destroy_process_group()
    proc.join()
    print(f"\n1. gloo all-reduce, 2 processes on this machine, fp32, median of {iters}")
    print(f"{'tokens':>8} {'bytes':>10} {'latency us':>11} {'GB/s':>7}")
    for t, numel in zip(tokens, sizes, strict=True):
        s = medians[numel]
        print(f"{t:>8} {numel * 4:>10,} {s * 1e6:>11.1f} {numel * 4 / s / 1e9:>7.2f}")
    return medians


# ---- 2. the engine, TP = 1 and TP = 2 ---------------------------------------------------------------------
def run_engine(model_dir: Path, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    import roseinfer.worker.tp_worker as rd
    from roseinfer import LLM, SamplingParams
    from roseinfer.model_executor.parallel_layers import CommStats

    torch.set_num_threads(tp)  # TP = 2 gives each rank tp // tp = 1 thread; TP = 1 gets 1
    if tp == 1:
        torch.set_num_threads(1)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    bcast = {"s": 0.0}
    original = rd.broadcast

    def timed_broadcast(obj, group):
        t0 = time.perf_counter()
        try:
            return original(obj, group)
        finally:
            bcast["s"] += time.perf_counter() - t0

    rd.broadcast = timed_broadcast
    CommStats.enabled, CommStats.seconds, CommStats.calls, CommStats.bytes = True, 0.0, 0, 0
    steps0 = llm.llm_engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    CommStats.enabled, rd.broadcast = False, original
    steps = llm.llm_engine.num_steps - steps0
    llm.close()
    n_out = sum(len(o.token_ids) for o in outs)
    return {"tp": tp, "seconds": elapsed, "tok_s": n_out / elapsed, "steps": steps, "allreduce_s": CommStats.seconds,
            "allreduce_calls": CommStats.calls, "allreduce_bytes": CommStats.bytes, "broadcast_s": bcast["s"],
            "ids": [o.token_ids for o in outs]}  # fmt: skip


def measure_engine(args) -> None:
    import random

    from benchmarks.benchmark import resolve_model

    model_dir = resolve_model("gpt2-medium", Path(args.cache_dir))
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    runs = {1: [], 2: []}
    for _ in range(args.repeats):
        for tp in (1, 2):
            runs[tp].append(run_engine(model_dir, tp, prompts, args.output_len))
    same = runs[1][0]["ids"] == runs[2][0]["ids"]
    print(f"\n2. gpt2-medium shapes, random weights, fp32, {args.num_requests} requests × {args.input_len} prompt "
          f"+ {args.output_len} output tokens, greedy, one thread per rank; median of {args.repeats}")  # fmt: skip
    print(f"{'TP':>3} {'output tok/s':>13} {'steps':>6} {'step ms':>8} {'all-reduces':>12} {'all-reduce s':>13} "
          f"{'share':>6} {'broadcast s':>12} {'share':>6}")  # fmt: skip
    for tp, rs in runs.items():
        r = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        print(f"{tp:>3} {r['tok_s']:>13.1f} {r['steps']:>6} {r['seconds'] / r['steps'] * 1e3:>8.1f} "
              f"{r['allreduce_calls']:>12} {r['allreduce_s']:>13.2f} {r['allreduce_s'] / r['seconds']:>6.0%} "
              f"{r['broadcast_s']:>12.3f} {r['broadcast_s'] / r['seconds']:>6.0%}")  # fmt: skip
    r2 = runs[2][0]
    print(
        f"TP = 2 tokens == TP = 1 tokens: {same}; all-reduce payload {r2['allreduce_bytes'] / 2**20:.1f} MiB "
        f"in {r2['allreduce_calls']} calls ({r2['allreduce_calls'] // r2['steps']} per step = 2 · n_layer)"
    )
    print("all runs, output tok/s: " + "; ".join(f"TP {tp}: " + ", ".join(f"{r['tok_s']:.1f}" for r in rs)
                                               for tp, rs in runs.items()))  # fmt: skip


# ---- 3. on paper --------------------------------------------------------------------------------------------
MODELS = {  # name: (parameters, n_layer, n_embd)
    "GPT-2 XL (1.5B)": (1.56e9, 48, 1600),
    "7B (LLaMA-like)": (6.7e9, 32, 4096),
}
GPU = dict(hbm=3.35e12, flops=989e12)  # an H100 SXM: HBM bytes/s, dense fp16 FLOP/s
# A ring all-reduce sends and receives at once, so a link counts with its bandwidth in ONE direction: an H100's
# NVLink moves 900 GB/s in both directions together, 450 GB/s each way; InfiniBand's 400 Gb/s is each way.
LINKS = {  # name: (bytes/s each way, latency per all-reduce in s): assumed round figures
    "NVLink 450 GB/s": (450e9, 10e-6),
    "IB 400 Gb/s": (50e9, 30e-6),
}


def step_time(params: float, n_layer: int, n_embd: int, tokens: int, n: int, link: str | None) -> tuple[float, ...]:
    """(compute s, all-reduce s) of one step of `tokens` tokens, fp16, on n GPUs: each GPU reads 1/n of the
    weights and does 1/n of the FLOPs (whichever takes longer), then 2 · n_layer ring all-reduces of
    tokens · n_embd · 2 bytes, each α + 2 (n - 1) / n · bytes / bandwidth."""
    compute = max(params * 2 / n / GPU["hbm"], 2 * params * tokens / n / GPU["flops"])
    if n == 1:
        return compute, 0.0
    bw, alpha = LINKS[link]
    nbytes = tokens * n_embd * 2
    return compute, 2 * n_layer * (alpha + 2 * (n - 1) / n * nbytes / bw)


def paper() -> None:
    print(
        f"\n3. on paper: one step, fp16, H100-class GPUs (HBM {GPU['hbm'] / 1e12:.2f} TB/s, "
        f"{GPU['flops'] / 1e12:.0f} TFLOP/s); all-reduce = α + 2(N-1)/N · bytes / bandwidth,"
    )
    print("   α = 10 us over NVLink (450 GB/s each way, 900 both ways), 30 us across nodes over InfiniBand "
          "(400 Gb/s = 50 GB/s each way)")  # fmt: skip
    print(f"{'model':<16} {'tokens':>6} {'link':<16} {'N':>2} {'compute ms':>11} {'all-reduce ms':>14} "
          f"{'step ms':>8} {'speedup':>8}")  # fmt: skip
    for name, (params, n_layer, n_embd) in MODELS.items():
        for tokens in (32, 2048):  # a decode batch of 32; a prefill chunk of 2048 tokens
            base = sum(step_time(params, n_layer, n_embd, tokens, 1, None))
            print(f"{name:<16} {tokens:>6} {'-':<16} {1:>2} {base * 1e3:>11.3f} {0:>14.3f} {base * 1e3:>8.3f} "
                  f"{1:>7.2f}x")  # fmt: skip
            for link in LINKS:
                for n in (2, 4, 8):
                    c, a = step_time(params, n_layer, n_embd, tokens, n, link)
                    print(f"{'':<16} {'':>6} {link:<16} {n:>2} {c * 1e3:>11.3f} {a * 1e3:>14.3f} "
                          f"{(c + a) * 1e3:>8.3f} {base / (c + a):>7.2f}x")  # fmt: skip
    params, n_layer, n_embd = MODELS["7B (LLaMA-like)"]
    tp16 = sum(step_time(params, n_layer, n_embd, 32, 16, "IB 400 Gb/s"))
    stage = sum(step_time(params / 2, n_layer // 2, n_embd, 32, 8, "NVLink 450 GB/s"))  # half the layers
    p2p = LINKS["IB 400 Gb/s"][1] + 32 * n_embd * 2 / LINKS["IB 400 Gb/s"][0]  # ONE send of the activations
    print(f"\n7B, decode batch 32, 16 GPUs in 2 nodes of 8:\n"
          f"  TP 16 across the nodes:          {tp16 * 1e3:.3f} ms a step\n"
          f"  TP 8 in each node, 2 pipeline stages: {stage * 1e3:.3f} ms a stage, a token's step "
          f"{(2 * stage + p2p) * 1e3:.3f} ms (one {p2p * 1e6:.0f} us send between the stages); with two batches "
          f"in flight one finishes every {stage * 1e3:.3f} ms")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["allreduce", "engine", "paper"])
    ap.add_argument("--iters", type=int, default=200, help="all-reduces per size")
    ap.add_argument("--repeats", type=int, default=1, help="engine runs per TP size (the median is printed)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "random-models"))
    args = ap.parse_args()
    if "allreduce" in args.parts:
        measure_allreduce([1, 8, 32, 128, 512, 2048], args.iters)
    if "engine" in args.parts:
        measure_engine(args)
    if "paper" in args.parts:
        paper()


if __name__ == "__main__":
    main()
