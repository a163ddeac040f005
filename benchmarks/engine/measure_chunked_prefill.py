"""Inter-token latency of short requests while long prompts arrive, with and without chunked prefill (chapter 09).

    python benchmarks/engine/measure_chunked_prefill.py                  # bundled model, writes results/ + the figure
    python benchmarks/engine/measure_chunked_prefill.py --threads 1 --model gpt2 --long-len 512

`--num-short` requests with short prompts decode `--short-tokens` tokens each; every `--every` steps a new
request with a `--long-len`-token prompt arrives (and decodes a few tokens). Without chunking the budget must
hold a whole context, so a step that admits a long prompt computes all of it next to the decodes, and every
short request waits for that step: its inter-token latency (ITL) spikes. With chunking the long prompt is cut
into pieces that fit what the decodes leave of the budget, so no step is much longer than the others. We time
every step and record, for each short request, the time between two consecutive tokens. Same requests, same
order, one process; each configuration is run --repeats times and the run with the median p99 is kept.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.benchmark import resolve_model
from roseinfer import LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def run(model_dir, args, chunked: bool, budget: int) -> dict:
    eng = LLMEngine(str(model_dir), device="cpu", max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                    max_num_seqs=args.num_short + args.num_long)  # fmt: skip
    vocab = eng.config.model_config.vocab_size - 1
    g = torch.Generator().manual_seed(0)
    short = SamplingParams(temperature=0, max_tokens=args.short_tokens, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(args.num_short):
        eng.add_request(f"s{i}", torch.randint(0, vocab, (16 + i % 17,), generator=g).tolist(), short)
    longs = [torch.randint(0, vocab, (args.long_len,), generator=g).tolist() for _ in range(args.num_long)]
    stamps: dict[str, list[float]] = {}
    step_ms, step, t_start = [], 0, time.perf_counter()
    while eng.has_unfinished_requests():
        if step % args.every == args.every - 1 and longs:
            eng.add_request(f"L{len(longs)}", longs.pop(), long)
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        step_ms.append((now - t0) * 1e3)
        for o in outs:
            if o.request_id.startswith("s"):
                stamps.setdefault(o.request_id, []).append(now)
        step += 1
    itl = [(b - a) * 1e3 for ts in stamps.values() for a, b in zip(ts, ts[1:], strict=False)]
    itl.sort()
    pct = lambda p: itl[min(len(itl) - 1, int(p / 100 * len(itl)))]
    return {"chunked": chunked, "budget": budget, "steps": step, "seconds": time.perf_counter() - t_start,
            "itl_p50_ms": pct(50), "itl_p99_ms": pct(99), "itl_max_ms": itl[-1], "itl_ms": itl,
            "step_ms": step_ms}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir, Hub id or gpt2[-medium] (random weights)")
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=96)
    ap.add_argument("--num-long", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=None, help="default: the context minus 12 (at most 512)")
    ap.add_argument("--every", type=int, default=12, help="a long prompt arrives every this many steps")
    ap.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens with chunking")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", type=Path, default=REPO / "results" / "chunked_prefill.json")
    ap.add_argument("--figure", type=Path, default=REPO / "chapters" / "09-one-forward-per-step" / "itl.png")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from roseinfer import DEFAULT_MODEL

    model_dir = resolve_model(args.model or DEFAULT_MODEL, REPO / ".cache" / "random-models")
    n_ctx = json.loads((model_dir / "config.json").read_text())["n_positions"]
    args.long_len = args.long_len or min(512, n_ctx - 12)
    configs = [(False, max(n_ctx, 2048)), (True, args.budget)]
    print(f"# {args.num_short} short requests x {args.short_tokens} tokens; {args.num_long} prompts of "
          f"{args.long_len} tokens, one every {args.every} steps; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'chunked prefill':<16} {'budget':>6} {'steps':>6} {'seconds':>8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} "
          f"{'ITL max ms':>11}")  # fmt: skip
    kept = []
    for chunked, budget in configs:
        runs = sorted((run(model_dir, args, chunked, budget) for _ in range(args.repeats)),
                      key=lambda r: r["itl_p99_ms"])  # fmt: skip
        r = runs[len(runs) // 2]
        kept.append(r)
        print(f"{'on' if chunked else 'off':<16} {budget:>6} {r['steps']:>6} {r['seconds']:>8.2f} "
              f"{r['itl_p50_ms']:>11.1f} {r['itl_p99_ms']:>11.1f} {r['itl_max_ms']:>11.1f}")  # fmt: skip
    off, on = kept
    print(f"chunked prefill cuts the p99 ITL {off['itl_p99_ms'] / on['itl_p99_ms']:.1f}x "
          f"({off['itl_p99_ms']:.1f} -> {on['itl_p99_ms']:.1f} ms); p50 {off['itl_p50_ms']:.1f} -> "
          f"{on['itl_p50_ms']:.1f} ms")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": kept}) + "\n")
    plot(kept, args.figure)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r, color in zip(runs, ("tab:red", "tab:blue"), strict=True):
        label = f"chunked, budget {r['budget']}" if r["chunked"] else "not chunked"
        itl = r["itl_ms"]
        ax1.plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], color=color, label=label)
        ax2.plot(r["step_ms"], color=color, lw=0.8, label=label)
    ax1.set(xscale="log", xlabel="inter-token latency of the short requests (ms)", ylabel="fraction of tokens",
            title="ITL distribution")  # fmt: skip
    ax1.axhline(0.99, color="grey", lw=0.5, ls="--")
    ax2.set(xlabel="engine step", ylabel="step time (ms)", title="every step's duration")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
