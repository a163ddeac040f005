"""This CPU's roofline, and where one decode step of GPT-2 small sits on it (chapter 17).

    python benchmarks/engine/roofline.py --threads 1 --json results/roofline-t1.json \
        --plot chapters/17-cpu-roofline/roofline.png
    python benchmarks/engine/roofline.py --threads 2 --engine      # + the GEMM rate inside a real engine run

It measures, on this machine and at these threads:
  1. the GEMM peak: GFLOP/s of oneDNN's packed linear on a big [1024, 3072] x [3072, 3072] problem (the most
     any fp32 GEMM reached here), and memory bandwidth: GB/s of summing a 512 MiB tensor (a pure read);
  2. every GEMM of a GPT-2-small step (c_attn, attn c_proj, c_fc, mlp c_proj, the LM head) at 1 to 256 rows,
     through F.linear (MKL's sgemm) and through oneDNN with the weight packed once, as GFLOP/s and % of peak;
  3. the step's FLOPs and bytes (weights once per step, plus the K/V read at a given context length), its
     arithmetic intensity, and the fastest step the roofline allows: max(FLOPs / peak, bytes / bandwidth);
  4. with --engine: an `LLM.generate` run of 32 requests under torch.profiler, with stage 16's CPU paths
     (linear_backend="aten", attention_backend="sdpa") and with stage 17's (onednn, cpu): the time and FLOPs of
     every linear call, i.e. the GEMM rate the engine really gets, as a share of the peak and of the roofline
     (each call's own bound, max(FLOPs / peak, bytes / bandwidth), summed over the calls), and the top ops.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
C, INNER, VOCAB, LAYERS = 768, 3072, 50257, 12  # GPT-2 small
SHAPES = {
    "c_attn": (3 * C, C),
    "attn.c_proj": (C, C),
    "c_fc": (INNER, C),
    "mlp.c_proj": (C, INNER),
    "lm_head": (VOCAB, C),
}  # fmt: skip  (out, in), as nn.Linear holds them
ROWS = (1, 8, 32, 64, 256)


def median_time(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_rates(m: int, n: int, k: int, reps: int) -> dict[str, float]:
    """GFLOP/s of x [m, k] times W [n, k]ᵀ (+ bias) through F.linear and through oneDNN's packed linear."""
    x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.02, torch.randn(n)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    flops = 2 * m * n * k
    aten = median_time(lambda: F.linear(x, w, b), reps)
    onednn = median_time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""), reps)
    return {"aten": flops / aten / 1e9, "onednn": flops / onednn / 1e9}


def bandwidth_gbs(reps: int = 7) -> float:
    """GB/s of reading 512 MiB (a sum touches every byte once; far bigger than any cache)."""
    x = torch.ones(128 * 2**20)
    return x.numel() * 4 / median_time(lambda: x.sum(), reps) / 1e9


def step_cost(rows: int, context: int) -> tuple[float, float]:
    """FLOPs and bytes of one decode step of `rows` sequences, each attending to `context` tokens (fp32)."""
    gemm = sum(2 * rows * n * k * (1 if name == "lm_head" else LAYERS) for name, (n, k) in SHAPES.items())
    attn = 2 * 2 * rows * context * C * LAYERS  # q·kᵀ and p·v
    weights = 4 * (LAYERS * sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head") + VOCAB * C)
    kv = 4 * 2 * rows * context * C * LAYERS
    return gemm + attn, weights + kv


ENGINE_PATHS = {"stage 16 (aten + sdpa)": dict(linear_backend="aten", attention_backend="sdpa"),
                "stage 17 (onednn + cpu)": dict(linear_backend="onednn", attention_backend="cpu")}  # fmt: skip
GEMM_OPS = ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise")


def engine_gemm_rate(peak_gflops: float, bandwidth: float, top: int = 6) -> dict:
    """LLM.generate of 32 requests under torch.profiler, with stage 16's and stage 17's CPU paths: every linear
    call's FLOPs over its time (the GEMM rate the engine really gets), and the ops that take the most time."""
    from benchmarks import benchmark
    from roseinfer import LLM, SamplingParams

    model = benchmark.resolve_model("gpt2", REPO / ".cache" / "random-models")
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(rng.randint(16, 128))] for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(32, 128), ignore_eos=True) for _ in range(32)]
    out = {}
    for label, paths in ENGINE_PATHS.items():
        llm = LLM(model=str(model), max_num_seqs=32, kv_cache_memory=4 * 2**30, **paths)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            total = time.perf_counter() - t0
        flops = secs = bound = 0.0  # bound: the time each call would take at the roofline, summed
        for ev in prof.events():
            if ev.name in GEMM_OPS:
                x_shape, w_shape = ev.input_shapes[1:3] if ev.name == "aten::addmm" else ev.input_shapes[0:2]
                rows, k = math.prod(x_shape[:-1]), x_shape[-1]
                n = w_shape[0] if ev.name == "mkldnn::_linear_pointwise" else w_shape[1]  # [out, in] | [in, out]
                flops += 2 * rows * n * k
                secs += ev.self_cpu_time_total / 1e6
                bound += max(2 * rows * n * k / (peak_gflops * 1e9), 4 * (n * k + rows * (n + k)) / (bandwidth * 1e9))
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        out[label] = {"seconds": total, "gemm_gflops": flops / secs / 1e9, "gemm_share_of_run": secs / total,
                      "gemm_share_of_roofline": bound / secs,
                      "top_ops": [(e.key, e.self_cpu_time_total / 1e6 / total, e.count) for e in ops]}  # fmt: skip
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="tokens each decode attends to (for the step's bytes)")
    ap.add_argument("--engine", action="store_true", help="also measure the GEMM rate inside LLM.generate")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="draw the roofline with the step's GEMMs on it (a PNG)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    peak = gemm_rates(1024, INNER, INNER, 5)
    peak_gflops, bw = max(peak.values()), bandwidth_gbs()
    print(f"threads {args.threads}: GEMM peak {peak_gflops:.1f} GFLOP/s (oneDNN {peak['onednn']:.1f}, MKL sgemm "
          f"{peak['aten']:.1f} on 1024x3072x3072), read bandwidth {bw:.1f} GB/s, "
          f"ridge at {peak_gflops / bw:.1f} FLOP/byte")  # fmt: skip
    report = {"threads": args.threads, "peak_gflops": peak, "bandwidth_gbs": bw, "gemms": [], "steps": []}
    print(f"\n{'GEMM':<12}{'rows':>5}{'FLOP/byte':>11}{'F.linear':>10}{'oneDNN':>9}   GFLOP/s (% of peak)")
    for rows in ROWS:
        for name, (n, k) in SHAPES.items():
            r = gemm_rates(rows, n, k, 5 if name == "lm_head" else 20)
            intensity = 2 * rows * n * k / (4 * (n * k + rows * (n + k)))
            report["gemms"].append({"name": name, "rows": rows, "out": n, "in": k, "intensity": intensity, **r})
            print(f"{name:<12}{rows:>5}{intensity:>11.1f}{r['aten']:>6.1f} ({100 * r['aten'] / peak_gflops:2.0f}%)"
                  f"{r['onednn']:>6.1f} ({100 * r['onednn'] / peak_gflops:2.0f}%)")  # fmt: skip
    print(f"\none decode step of GPT-2 small, fp32, {args.context} tokens of context per sequence:")
    print(f"{'rows':>5}{'GFLOP':>8}{'MB':>8}{'FLOP/byte':>11}{'bound':>9}{'fastest step':>14}{'tok/s ceiling':>15}")
    for rows in ROWS:
        flops, nbytes = step_cost(rows, args.context)
        t_min = max(flops / (peak_gflops * 1e9), nbytes / (bw * 1e9))
        bound = "compute" if flops / (peak_gflops * 1e9) > nbytes / (bw * 1e9) else "memory"
        report["steps"].append({"rows": rows, "flops": flops, "bytes": nbytes, "min_step_s": t_min, "bound": bound})
        print(f"{rows:>5}{flops / 1e9:>8.2f}{nbytes / 1e6:>8.0f}{flops / nbytes:>11.1f}{bound:>9}"
              f"{1e3 * t_min:>11.1f} ms{rows / t_min:>15.0f}")  # fmt: skip
    if args.engine:
        report["engine"] = engine_gemm_rate(peak_gflops, bw)
        for label, r in report["engine"].items():
            print(f"\nLLM.generate, 32 requests, {label}: {r['seconds']:.2f} s under the profiler; the GEMMs run at "
                  f"{r['gemm_gflops']:.1f} GFLOP/s = {100 * r['gemm_gflops'] / peak_gflops:.0f}% of the peak and "
                  f"{100 * r['gemm_share_of_roofline']:.0f}% of the roofline (each call's own bound), "
                  f"{100 * r['gemm_share_of_run']:.0f}% of the run's time")  # fmt: skip
            for name, share, calls in r["top_ops"]:
                print(f"    {name:<52}{100 * share:5.1f}% of the run  {calls:6d} calls")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bw = max(report["peak_gflops"].values()), report["bandwidth_gbs"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [2**i / 8 for i in range(12)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], "k-", label=f"roofline: {peak:.0f} GFLOP/s, {bw:.0f} GB/s")
    for backend, marker in (("aten", "o"), ("onednn", "s")):
        pts = report["gemms"]
        label = "F.linear (MKL sgemm)" if backend == "aten" else "oneDNN, weight packed once"
        ax.scatter([g["intensity"] for g in pts], [g[backend] for g in pts], marker=marker, label=label, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights and activations)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"GPT-2-small GEMMs at 1-256 rows, {report['threads']} thread(s)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
