"""Chapter 12's numbers: what a preemption costs by swap and by recompute, and what the watermark saves.

    python benchmarks/engine/measure_swap.py                          # all three parts, bundled model
    python benchmarks/engine/measure_swap.py --part cost --model gpt2 --figure swap_vs_recompute.png
    python benchmarks/engine/measure_swap.py --part watermark --num-blocks 96 128

Part "cost" (measured here): for a sequence of L tokens, the time to swap its blocks out and back in
(`swap_blocks`, device pool <-> host pool, every layer) against the time to recompute its K/V (one
prefill forward of L tokens through the model runner). Median of --repeats. On a CPU both pools are in
the same RAM, so a swap is two memcpys of the sequence's K/V.

Part "paper" (computed, not measured): the same two costs on an H100 SXM for the model's shapes, from
its K/V bytes per token over PCIe 5 (about 64 GB/s each way) and its prefill FLOPs at the card's dense
bf16 rate (989 TFLOP/s) times an assumed utilisation; the crossover length is where they are equal.

Part "watermark": the `mixed` workload of scripts/benchmark.py on a pool of --num-blocks blocks, once per
--watermarks value; prints the preemptions of each run (deterministic: greedy, the same requests).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.benchmark import REPO, make_workload, resolve_model
from benchmarks.common import drain
from roseinfer import LLMEngine, SamplingParams  # noqa: E402
from roseinfer.model_executor.loader import read_model_config, resolve_model_dir  # noqa: E402
from roseinfer.worker.kv_cache import swap_blocks  # noqa: E402

PCIE5_BYTES_PER_S = 64e9  # x16, one direction
H100_BF16_FLOPS = 989e12  # dense


def measure_cost(model_dir: str | None, lengths: list[int], repeats: int) -> list[dict]:
    eng = LLMEngine(model_dir, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=4096,
                    enable_prefix_caching=False, swap_space=1)  # fmt: skip
    core = eng.engine_core.engine_core  # the in-process EngineCore: this measurement times its parts one by one
    kv, runner = core.kv_cache_manager, core.model_runner
    rows = []
    for L in lengths:
        recompute, swap = [], []
        for r in range(repeats + 1):  # the first round warms up
            rid = f"L{L}-{r}"
            # max_tokens 2: after its prefill the request still runs, so it still holds its blocks
            eng.add_request(rid, [(7 * i + r) % 4000 for i in range(L)], SamplingParams(temperature=0, max_tokens=2))
            sched = core.scheduler.schedule()
            t0 = time.perf_counter()
            out = runner.execute_model(sched)  # the prefill of L tokens: what a recompute redoes
            t1 = time.perf_counter()
            core.scheduler.update_from_output(sched, out)
            t2 = time.perf_counter()
            out_pairs = kv.swap_out([rid])
            swap_blocks(runner.kv_cache.layers, runner.host_kv_cache.layers, out_pairs)
            in_pairs = kv.swap_in([rid])
            swap_blocks(runner.host_kv_cache.layers, runner.kv_cache.layers, in_pairs)
            t3 = time.perf_counter()
            eng.abort_request(rid)
            if r:
                recompute.append(t1 - t0)
                swap.append(t3 - t2)  # the KV cache manager's bookkeeping is inside too: it is part of a swap
        nbytes = 2 * kv.blocks_for(L) * eng.config.model_config.kv_bytes_per_token() * kv.block_size  # out, back in
        rows.append({"L": L, "recompute_ms": 1e3 * statistics.median(recompute),
                     "swap_ms": 1e3 * statistics.median(swap), "bytes": nbytes})  # fmt: skip
    return rows


def paper(cfg, lengths: list[int], mfu: float, kv_bytes: int = 2) -> tuple[list[dict], int | None]:
    """H100 on paper: swap = 2 * L * kv_bytes_per_token / PCIe; recompute = prefill FLOPs / (peak * mfu)."""
    d, n_layer = cfg.n_embd, cfg.n_layer
    per_token = 2 * n_layer * d * kv_bytes  # K and V, every layer, bf16
    matmul_params = n_layer * 12 * d * d  # q, k, v, o (4 d^2) and the MLP (8 d^2) of every layer
    rate = H100_BF16_FLOPS * mfu

    def costs(L: int) -> tuple[float, float]:
        flops = 2 * matmul_params * L + 2 * n_layer * L * L * d  # linears + causal attention (QK^T and PV)
        return 2 * L * per_token / PCIE5_BYTES_PER_S, flops / rate

    rows = [{"L": L, "swap_us": 1e6 * costs(L)[0], "recompute_us": 1e6 * costs(L)[1]} for L in lengths]
    cross = next((L for L in range(1, 1 << 20) if costs(L)[0] <= costs(L)[1]), None)
    return rows, cross


def watermark_counts(model_dir, num_blocks: int, watermarks: list[float], mode: str | None) -> list[tuple]:
    keys = ("num_requests", "input_len", "output_len", "long_fraction", "long_len", "shared_prefix", "text_file")
    ns = argparse.Namespace(workload="mixed", seed=0, prompt_source="random", **dict.fromkeys(keys))
    out = []
    for wm in watermarks:
        eng = LLMEngine(model_dir, device="cpu", dtype="float32", num_blocks=num_blocks, max_num_seqs=32,
                        watermark=wm, preemption_mode=mode)  # fmt: skip
        cfg = eng.config.model_config.hf_config
        wl = make_workload(
            ns, cfg.n_positions, cfg.vocab_size, Path(model_dir or REPO / "roseinfer/models/tiny-shakespeare")
        )
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        drain(eng)
        s = eng.get_stats()
        watermark_blocks = eng.engine_core.engine_core.kv_cache_manager.watermark_blocks  # (the in-process core)
        out.append((wm, watermark_blocks, s["num_preemptions"], eng.num_steps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or gpt2[-medium|-large|-xl] (random weights)")
    ap.add_argument("--part", choices=["cost", "paper", "watermark", "all"], default="all")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 511])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mfu", type=float, nargs="+", default=[1.0, 0.4], help="utilisation assumed on paper")
    ap.add_argument("--num-blocks", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--watermarks", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.1])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--figure", default=None, help="plot part cost here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model, REPO / ".cache" / "random-models")) if args.model else None
    cfg = read_model_config(resolve_model_dir(model_dir))  # GPT2Config: layers, width, context
    print(f"model {args.model or 'bundled'}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, context {cfg.n_positions}; "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    lengths = [n for n in args.lengths if n < cfg.n_positions]

    if args.part in ("cost", "all"):
        rows = measure_cost(model_dir, lengths, args.repeats)
        print("\nmeasured on this CPU (fp32): one sequence of L tokens, median of", args.repeats)
        print("      L   recompute ms   swap out+in ms   K/V bytes moved   swap / recompute")
        for r in rows:
            print(f"  {r['L']:5d}   {r['recompute_ms']:12.2f}   {r['swap_ms']:14.3f}   {r['bytes']:15,d}"
                  f"   {r['swap_ms'] / r['recompute_ms']:16.3f}")  # fmt: skip
        if args.figure:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.6))
            ax.plot([r["L"] for r in rows], [r["recompute_ms"] for r in rows], "o-", label="recompute (prefill)")
            ax.plot([r["L"] for r in rows], [r["swap_ms"] for r in rows], "s-", label="swap out + in")
            ax.set(xlabel="sequence length L (tokens)", ylabel="ms", yscale="log",
                   title=f"preempting one sequence, CPU, {args.model or 'bundled model'}")  # fmt: skip
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.figure, dpi=110)
            print(f"wrote {args.figure}")

    if args.part in ("paper", "all"):
        for mfu in args.mfu:
            rows, cross = paper(cfg, lengths, mfu)
            print(f"\non paper, H100 SXM, bf16, PCIe 5 at 64 GB/s, prefill at {mfu:.0%} of 989 TFLOP/s:")
            print("      L   swap out+in us   recompute us")
            for r in rows:
                print(f"  {r['L']:5d}   {r['swap_us']:14.1f}   {r['recompute_us']:12.1f}")
            print(f"  swap is cheaper from L = {cross:,} tokens on" if cross else "  swap is never cheaper")

    if args.part in ("watermark", "all"):
        for nb in args.num_blocks:
            print(f"\nwatermark, mixed workload (64 requests, max 32 running), pool of {nb} blocks of 16:")
            print("  watermark   blocks kept free   preemptions   steps")
            for wm, blocks, n, steps in watermark_counts(model_dir, nb, args.watermarks, None):
                print(f"  {wm:9.2f}   {blocks:16d}   {n:11d}   {steps:5d}")


if __name__ == "__main__":
    main()
