"""Latency against request rate: roseinfer's server and Hugging Face's `transformers serve`, in one run.

    python benchmarks/serving/serving_curve.py                                   # bundled model, rates 0.5 .. inf
    python benchmarks/serving/serving_curve.py --rates 0.5 1 2 inf --num-requests 32 --figure serving_curve.png

Each server is started on a free loopback port, warmed up with one request, measured at every rate with
benchmarks/serving/bench_serving.py (the same seeded prompts, lengths and Poisson arrivals for every server), and
stopped before the next one starts, so that they never share the CPU. The peers:

    roseinfer    python -m roseinfer serve (continuous batching, paged KV, one forward per step)
    hf-serve     transformers serve --device cpu (one request at a time)
    hf-serve-cb  transformers serve --device cpu --continuous-batching (HF's paged continuous batching;
                 --cb-num-blocks and --cb-max-batch-tokens keep its KV cache small on CPU)

Requests are greedy and do not send `ignore_eos` (transformers serve refuses it); both servers run the
same weights, so they generate the same tokens. Below its saturation a server's output tok/s is just the
offered load (rate x mean output length), so the summary compares what each server *sustains*: its
highest measured rate with p99 TTFT under 2 s, and the output tok/s there.

This is a latency curve, not a capacity measurement: a rate gets at most --max-requests requests (200 are 8 s
at 24 req/s, too short for a queue to show), and tok/s here is tokens / (arrivals + drain). For the highest rate a
server sustains, held for a fixed time and judged on achieved against offered throughput as well as p99 TTFT,
use benchmarks/serving/serving_capacity.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import free_port, start_server
from benchmarks.serving.bench_serving import make_requests, run_benchmark

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "roseinfer" / "models" / "tiny-shakespeare"


def server_command(name: str, port: int, model_dir: Path, cb_num_blocks: int) -> tuple[list[str], str]:
    """The command line of a peer and the `model` its requests must name."""
    venv_bin = Path(sys.executable).parent
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "roseinfer":
        return [sys.executable, "-m", "roseinfer", "serve", "--model", str(model_dir), "--device", "cpu",
                "--served-model-name", "roseinfer", *common], "roseinfer"  # fmt: skip
    hf = [str(venv_bin / "transformers"), "serve", "--device", "cpu", *common]
    if name == "hf-serve-cb":
        hf += ["--continuous-batching", "--cb-num-blocks", str(cb_num_blocks), "--cb-max-batch-tokens", "256"]
    return hf, str(model_dir)


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    return start_server(cmd, port, log=log)


def run_peer(name: str, args, prompts, output_lens, log_dir: Path) -> list[dict]:
    port = free_port()
    cmd, model = server_command(name, port, args.model_dir, args.cb_num_blocks)
    proc = start(cmd, port, log_dir / f"{name}.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        warm = asyncio.run(run_benchmark(base, model, prompts[:1], [4], float("inf"), 0, ignore_eos=False))
        if warm["failures"]:
            raise SystemExit(f"{name}: the warm-up request failed: {warm.get('errors')}")
        rows = []
        for rate in args.rates:
            n = args.max_requests if rate == float("inf") else int(rate * args.seconds_per_rate)
            n = min(args.max_requests, max(args.num_requests, n))
            rep = asyncio.run(run_benchmark(base, model, prompts[:n], output_lens[:n], rate, args.seed,
                                            ignore_eos=False))  # fmt: skip
            rep.pop("requests", None)
            rep |= {"peer": name, "rate": rate}
            rows.append(rep)
            print(f"  {name:12s} rate {rate:>5} ({n:3d} req): {rep['output_throughput']:7.1f} tok/s  "
                  f"TTFT p50/p99 {rep['p50_ttft_ms']:8.0f} / {rep['p99_ttft_ms']:8.0f} ms  "
                  f"TPOT p50 {rep['p50_tpot_ms']:6.1f} ms  failures {rep['failures']}", flush=True)  # fmt: skip
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summarize(rows: list[dict], peers: list[str]) -> list[str]:
    """Each peer's highest request rate (of those measured, `inf` aside) with p99 TTFT under 2 s and no failures,
    and its output tok/s there: the throughput it sustains under that latency target. Then roseinfer against
    each HF peer: sustained throughput, and p99 TTFT at the HF peer's highest rate."""
    by = {(r["peer"], r["rate"]): r for r in rows}
    best = {}
    for peer in peers:
        ok = [r["rate"] for r in rows if r["peer"] == peer and r["rate"] != float("inf")
              and r["p99_ttft_ms"] < 2000 and not r["failures"]]  # fmt: skip
        best[peer] = max(ok) if ok else None
    lines = []
    for peer in peers:
        rate = best[peer]
        lines.append(f"{peer:12s} highest rate with p99 TTFT < 2 s: {rate}; output tok/s there: "
                     + (f"{by[(peer, rate)]['output_throughput']:.1f}" if rate else "-"))  # fmt: skip
    ours = best.get("roseinfer")
    for peer in [p for p in peers if p != "roseinfer" and best[p] and ours]:
        a, b = by[("roseinfer", ours)], by[(peer, best[peer])]
        same = by.get(("roseinfer", best[peer]))
        lines.append(f"roseinfer vs {peer}: sustained output tok/s {a['output_throughput']:.1f} vs "
                     f"{b['output_throughput']:.1f} = {a['output_throughput'] / b['output_throughput']:.2f}x; at rate "
                     f"{best[peer]} p99 TTFT {same['p99_ttft_ms']:.0f} vs {b['p99_ttft_ms']:.0f} ms")  # fmt: skip
    return lines


def plot(rows: list[dict], peers: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["rate"] for r in rows if r["rate"] != float("inf")})
    at_inf = finite[-1] * 1.6  # where the all-at-once burst is drawn
    x = lambda r: at_inf if r["rate"] == float("inf") else r["rate"]  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for peer in peers:
        rs = [r for r in rows if r["peer"] == peer]
        ax1.plot([x(r) for r in rs], [r["p99_ttft_ms"] / 1e3 for r in rs], "o-", label=peer)
        ax2.plot([x(r) for r in rs], [r["output_throughput"] for r in rs], "o-", label=peer)
    ax1.axhline(2, color="gray", ls="--", lw=0.8)
    ticks = [*finite, at_inf]
    for ax, ylabel, title in ((ax1, "p99 TTFT (s)", "time to first token"), (ax2, "output tokens / s", "throughput")):
        ax.set(xscale="log", xlabel="offered request rate (req/s; Poisson)", ylabel=ylabel, title=title)
        ax.set_xticks(ticks, [f"{t:g}" for t in finite] + ["inf"])
        ax.minorticks_off()
    ax1.set_yscale("log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=BUNDLED)
    ap.add_argument("--peers", nargs="+", default=["roseinfer", "hf-serve", "hf-serve-cb"])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8, 16, 24, 32, float("inf")])
    ap.add_argument("--num-requests", type=int, default=48, help="requests per rate, at least")
    ap.add_argument("--seconds-per-rate", type=float, default=25, help="more requests at high rates: rate x this")
    ap.add_argument("--max-requests", type=int, default=200, help="requests per rate, at most")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cb-num-blocks", type=int, default=64, help="KV blocks for hf-serve-cb (256 tokens each)")
    ap.add_argument("--json", type=Path, default=REPO / "results" / "serving_curve.json")
    ap.add_argument("--figure", default=None)
    ap.add_argument("--replot", action="store_true", help="only redraw --figure and the summary from --json")
    args = ap.parse_args()
    if args.replot:
        rows = json.loads(args.json.read_text())
        for r in rows:
            r["rate"] = float(r["rate"])
        print("\n".join(summarize(rows, args.peers)))
        if args.figure:
            plot(rows, args.peers, args.figure)
        return
    prompts, output_lens = make_requests(args.max_requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    print(f"{args.num_requests} to {args.max_requests} requests per rate (about {args.seconds_per_rate:g} s of "
          f"arrivals), prompts of {args.input_len[0]}-{args.input_len[1]} words, "
          f"{args.output_len[0]}-{args.output_len[1]} new tokens, greedy; model {args.model_dir}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for peer in args.peers:
        rows += run_peer(peer, args, prompts, output_lens, args.json.parent)
        args.json.write_text(json.dumps(rows, indent=1, default=str))  # after every peer: a crash loses less
    args.json.write_text(json.dumps(rows, indent=1, default=str))
    print("\n".join(["", *summarize(rows, args.peers)]))
    if args.figure:
        plot(rows, args.peers, args.figure)


if __name__ == "__main__":
    main()
