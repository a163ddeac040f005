"""Serving capacity: the highest request rate each server sustains, roseinfer against vLLM and transformers serve.

    python benchmarks/serving/serving_capacity.py                      # every engine, rates 2 4 8 16 32
    python benchmarks/serving/serving_capacity.py --engines roseinfer vllm-cpu --rates 8 16 --duration 60 \
        --search-steps 3
    python benchmarks/serving/serving_capacity.py --engine-rates hf-serve=1,2,4 --plot
    python benchmarks/serving/serving_capacity.py --replot results/19-openai-serving/capacity-t2-r1.json

For each engine in turn (never two at once): start its OpenAI-compatible server on a free loopback port
(serving_peers.py: the same model, KV budget, thread count and batch caps for all), warm it up, then hold
each offered rate for --duration seconds of Poisson arrivals and judge it (serving_window.py):

    sustained  =  achieved output tok/s >= 95% of offered  AND  p99 TTFT <= --max-p99-ttft-ms  AND  no failures

The rates go up from --rates (or the engine's --engine-rates) and stop at the first rate not sustained; then up to
--search-steps more rates bracket and narrow the capacity (double, halve or bisect). After every rate a probe
request (4 tokens) waits until the server is idle again, so that the next rate starts on an empty server.
Every engine gets the same workload: the same seed, so the same arrival schedule (scaled by the rate) and the same
prompts in the same order. Requests are greedy and streamed; engines that accept `ignore_eos` (roseinfer, vLLM)
get it so that every request generates max_tokens tokens; transformers serve refuses the field, and the rows count
requests that ended early ("short").

The load generator runs on the same machine and costs the server CPU time; it does the same work for every engine.
vLLM's CPU build pins its --threads OpenMP threads to cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND; one you set
is kept, and recorded with the engine's environment in the JSON); its API server and engine-core processes run
beside them.

Output: a table per engine, the capacity of each (lead line), the ratios roseinfer / peer at the same bound, and a
JSON file (environment, settings, every rate's numbers, capacities, ratios) after every engine; --plot draws
achieved against offered output tok/s and p99 TTFT against rate.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import cpu_model, free_port
from benchmarks.serving.bench_serving import json_safe
from benchmarks.serving.serving_model import model_dir
from benchmarks.serving.serving_peers import (
    BUNDLED,
    ENGINES,
    Server,
    ServerConfig,
    missing_peer,
    server_spec,
)
from benchmarks.serving.serving_window import Criteria, Workload, capacity, hold_rate, sweep, warm_up

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "results" / "19-openai-serving"


def environment(cfg: ServerConfig) -> dict:
    """What the numbers depend on besides the code: the CPU, the thread count, the load when we started."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "threads": cfg.threads, "loadavg_at_start": os.getloadavg(), "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"), "platform": platform.platform()}  # fmt: skip


def measure_engine(engine: str, cfg: ServerConfig, rates: list[float], args, log_dir: Path) -> dict:
    """Start `engine`, sweep `rates` upwards until one is not sustained, search, stop it. Returns its record."""
    port = free_port()
    spec = server_spec(engine, port, cfg)
    crit = Criteria(args.min_ratio, args.max_p99_ttft_ms, args.max_failed_frac)
    wl = Workload(tuple(args.input_len), tuple(args.output_len), args.seed)
    record = {"engine": engine, "version": spec.version, "command": spec.cmd, "env": spec.env, "kv": spec.kv,
              "model": spec.model, "ignore_eos": spec.ignore_eos, "rows": []}  # fmt: skip
    rows = record["rows"]
    t0 = time.perf_counter()
    with Server(spec, port, log_dir / f"{engine}.log") as server:
        record["startup_s"] = server.startup_s
        print(f"\n[{engine}] {spec.version} up in {server.startup_s:.0f} s on {server.base_url}; KV {spec.kv}",
              flush=True)  # fmt: skip
        warm_up(server.base_url, spec.model, wl, spec.ignore_eos, engine)

        def measure(rate: float) -> dict:
            row = hold_rate(server.base_url, spec.model, rate, args.duration, args.warmup_frac, args.grace,
                            args.settle_timeout, wl, crit, spec.ignore_eos)  # fmt: skip
            print(format_row(engine, row), flush=True)
            return row

        try:
            sweep(measure, rates, args.search_steps, args.resolution, args.full_sweep, rows)
        except RuntimeError as e:  # the probe failed: the server is wedged; keep what was measured
            record["error"] = str(e)[:2000]
            print(f"  {engine}: stopped: {e}", flush=True)
    record["wall_s"] = time.perf_counter() - t0
    record |= capacity(rows)
    at = [r for r in rows if r["rate"] == record["capacity_req_s"] and r["sustained"]]
    record["capacity_output_tok_s"] = at[0]["achieved_output_tok_s"] if at else None
    return record


def format_row(engine: str, r: dict) -> str:
    verdict = "sustained" if r["sustained"] else "NOT: " + "; ".join(r["why_not"])
    return (f"  {engine:11s} {r['rate']:6g} req/s  offered {r['offered_output_tok_s']:7.1f}  achieved "
            f"{r['achieved_output_tok_s']:7.1f} tok/s ({r['achieved_ratio']:5.1%})  TTFT p50/p99 "
            f"{r['p50_ttft_ms']:7.0f}/{r['p99_ttft_ms']:7.0f} ms  TPOT p99 {r['p99_tpot_ms']:6.1f}  "
            f"done/failed/cut {r['completed']}/{r['failed']}/{r['cut']}  drain {r['drain_s']:.1f} s  "
            f"settle {r['settle_s']:.1f} s  {verdict}")  # fmt: skip


def ratios(engines: dict) -> dict:
    """roseinfer / peer: capacity in req/s, and achieved output tok/s at each one's capacity."""
    ours = engines.get("roseinfer")
    out = {}
    for name, rec in engines.items():
        if name == "roseinfer" or not ours or "rows" not in rec or "rows" not in ours:
            continue
        a, b = ours["capacity_req_s"], rec["capacity_req_s"]
        ta, tb = ours["capacity_output_tok_s"], rec["capacity_output_tok_s"]
        out[f"roseinfer/{name}"] = {
            "capacity_req_s": a / b if a and b else None,
            "output_tok_s_at_capacity": ta / tb if ta and tb else None,
            "bracketed": ours["first_unsustained_req_s"] is not None and rec["first_unsustained_req_s"] is not None,
        }
    return out


COLUMNS = (  # title, row key, width, format
    ("engine", "", 11, "s"), ("req/s", "rate", 6, "g"), ("offered", "offered_output_tok_s", 8, ".1f"),
    ("achieved", "achieved_output_tok_s", 8, ".1f"), ("ratio", "achieved_ratio", 6, ".1%"),
    ("TTFT p50", "p50_ttft_ms", 8, ".0f"), ("p99", "p99_ttft_ms", 7, ".0f"), ("TPOT p99", "p99_tpot_ms", 8, ".1f"),
    ("ITL p99", "p99_itl_ms", 7, ".1f"), ("E2E p99", "p99_e2e_ms", 8, ".0f"), ("done", "completed", 5, "d"),
    ("failed", "failed", 6, "d"), ("cut", "cut", 4, "d"),
)  # fmt: skip


def table(doc: dict) -> str:
    """The capacity lead lines, the ratios, then every rate of every engine."""
    lines = [f"sustained = {doc['settings']['criteria_text']}", ""]
    for name, rec in doc["engines"].items():
        if "rows" not in rec:
            lines.append(f"{name:12s} skipped: {rec['skipped']}")
            continue
        cap, hi = rec["capacity_req_s"], rec["first_unsustained_req_s"]
        if cap is None and hi is None:
            what = f"unknown: no rate measured ({rec.get('error', '')[:200]})"
        elif cap is None:
            what = f"< {hi:g} req/s (the lowest rate measured was not sustained)"
        else:
            what = f"{cap:g} req/s ({rec['capacity_output_tok_s']:.1f} output tok/s)"
            what += f", not {hi:g}" if hi is not None else f", or more: no rate up to {cap:g} failed"
        lines.append(f"{name:12s} capacity {what}" + ("" if rec["monotone"] else
                     f"  [a higher rate, {rec['highest_sustained_req_s']:g}, passed: noise]"))  # fmt: skip
    for pair, r in doc["ratios"].items():
        cap = f"{r['capacity_req_s']:.2f}x" if r["capacity_req_s"] else "-"
        tok = f"{r['output_tok_s_at_capacity']:.2f}x" if r["output_tok_s_at_capacity"] else "-"
        lines.append(f"{pair}: capacity {cap} req/s, {tok} output tok/s at capacity"
                     + ("" if r["bracketed"] else "  (not bracketed: a bound, not a ratio)"))  # fmt: skip
    align = ["<" if fmt == "s" else ">" for *_, fmt in COLUMNS]  # names to the left, numbers to the right
    lines.append("\n" + " ".join(f"{t:{a}{w}}" for (t, _, w, _), a in zip(COLUMNS, align, strict=True)) + "  sustained")
    for name, rec in doc["engines"].items():
        for r in sorted(rec.get("rows", []), key=lambda r: r["rate"]):
            cells = [name] + [r[key] for _, key, _, _ in COLUMNS[1:]]
            specs = [f"{a}{w}{fmt}" for (_, _, w, fmt), a in zip(COLUMNS, align, strict=True)]
            line = " ".join(format(v, spec) for v, spec in zip(cells, specs, strict=True))
            lines.append(f"{line}  {'yes' if r['sustained'] else 'no'}")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    top = 0.0
    for name, rec in doc["engines"].items():
        rows = sorted(rec.get("rows", []), key=lambda r: r["rate"])
        if not rows:
            continue
        top = max(top, *(r["offered_output_tok_s"] for r in rows))
        line = ax1.plot([r["offered_output_tok_s"] for r in rows], [r["achieved_output_tok_s"] for r in rows], "o-",
                        label=name)[0]  # fmt: skip
        ax2.plot([r["rate"] for r in rows], [r["p99_ttft_ms"] / 1e3 for r in rows], "o-", color=line.get_color(),
                 label=name)  # fmt: skip
        bad = [r for r in rows if not r["sustained"]]  # rates not sustained: hollow markers
        for ax, x, y in ((ax1, "offered_output_tok_s", "achieved_output_tok_s"), (ax2, "rate", "p99_ttft_ms")):
            scale = 1e3 if y == "p99_ttft_ms" else 1.0
            ax.plot([r[x] for r in bad], [r[y] / scale for r in bad], "o", color="white", markersize=4)
    crit = doc["settings"]
    ax1.plot([0, top], [0, top], color="gray", lw=0.8, label="achieved = offered")
    ax1.plot([0, top], [0, crit["min_ratio"] * top], color="gray", lw=0.8, ls="--", label=f"{crit['min_ratio']:.0%}")
    ax1.set(xlabel="offered output tok/s", ylabel="achieved output tok/s", title="throughput")
    ax2.axhline(crit["max_p99_ttft_ms"] / 1e3, color="gray", ls="--", lw=0.8, label="bound")
    ax2.set(xlabel="offered rate (req/s, Poisson)", ylabel="p99 TTFT (s)", title="time to first token", yscale="log")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.suptitle(f"{crit['duration_s']:g} s per rate, {doc['environment']['threads']} threads; hollow: not sustained",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def default_out(threads: int) -> Path:
    """results/19-openai-serving/capacity-t<threads>-r<n>.json with the first free n."""
    n = 1
    while (DATA / f"capacity-t{threads}-r{n}.json").exists():
        n += 1
    return DATA / f"capacity-t{threads}-r{n}.json"


def parse_engine_rates(items: list[str]) -> dict[str, list[float]]:
    out = {}
    for item in items:
        name, _, rates = item.partition("=")
        if name not in ENGINES or not rates:
            raise SystemExit(f"--engine-rates {item!r}: want ENGINE=R1,R2,... with ENGINE one of {', '.join(ENGINES)}")
        out[name] = [float(r) for r in rates.split(",")]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16, 32], help="req/s, swept upwards")
    ap.add_argument("--engine-rates", nargs="*", default=[], metavar="ENGINE=R1,R2", help="an engine's own rates")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (no request cap)")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="first share of the window not measured")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds after the window before requests are cut")
    ap.add_argument("--settle-timeout", type=float, default=600.0, help="seconds the idle probe may wait")
    ap.add_argument("--max-p99-ttft-ms", type=float, default=2000.0, help="the latency bound of 'sustained'")
    ap.add_argument("--min-ratio", type=float, default=0.95, help="achieved / offered output tok/s of 'sustained'")
    ap.add_argument("--max-failed-frac", type=float, default=0.0)
    ap.add_argument("--search-steps", type=int, default=2, help="extra rates to bracket and bisect capacity")
    ap.add_argument("--resolution", type=float, default=0.1, help="stop bisecting when hi / lo <= 1 + this")
    ap.add_argument("--full-sweep", action="store_true", help="measure every rate, even above a failed one")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=model_dir, default=BUNDLED, help="a directory, or a random shape: smollm2-135m")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="every engine's KV pool")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--out", type=Path, default=None, help="JSON (default: results/19-openai-serving/)")
    ap.add_argument("--plot", action="store_true", help="also draw <out>.png")
    ap.add_argument("--replot", type=Path, default=None, help="only print the table and plot of this JSON")
    args = ap.parse_args()
    if args.replot:
        doc = json.loads(args.replot.read_text())
        print(table(doc))
        plot(doc, args.replot.with_suffix(".png"))
        return 0
    if not (0 <= args.warmup_frac < 1 and args.duration > 0 and args.grace >= 0):
        ap.error("need duration > 0, 0 <= warmup-frac < 1, grace >= 0")
    engine_rates = parse_engine_rates(args.engine_rates)
    cfg = ServerConfig(args.model_dir, args.threads, args.kv_cache_mib * 2**20, args.max_num_seqs,
                       args.max_num_batched_tokens, args.max_model_len,
                       vllm_enforce_eager=args.vllm_enforce_eager)  # fmt: skip
    out = args.out or default_out(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    crit = Criteria(args.min_ratio, args.max_p99_ttft_ms, args.max_failed_frac)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "replot", "plot")}
    settings |= {"duration_s": args.duration, "criteria_text": crit.describe(), "server_config": asdict(cfg)}
    doc = {"environment": environment(cfg), "settings": settings, "engines": {}, "ratios": {}}
    print(f"{args.duration:g} s per rate (first {args.warmup_frac:.0%} not measured, grace {args.grace:g} s); "
          f"sustained = {crit.describe()}; {args.threads} threads, KV {args.kv_cache_mib} MiB each",
          flush=True)  # fmt: skip
    for engine in args.engines:
        if why := missing_peer(engine):
            print(f"\n[{engine}] skipped: {why}", flush=True)
            doc["engines"][engine] = {"skipped": why}
        else:
            rates = engine_rates.get(engine, args.rates)
            try:
                doc["engines"][engine] = measure_engine(engine, cfg, rates, args, REPO / "results" / "serving-logs")
            except RuntimeError as e:
                print(f"\n[{engine}] failed: {e}", flush=True)
                doc["engines"][engine] = {"skipped": f"failed: {str(e)[:2000]}"}
        doc["ratios"] = ratios(doc["engines"])
        doc["environment"]["loadavg_at_end"] = os.getloadavg()
        out.write_text(json.dumps(to_json(doc), indent=1) + "\n")  # after every engine: a crash loses less
    print("\n" + table(doc))
    print(f"wrote {out}")
    if args.plot:
        plot(doc, out.with_suffix(".png"))
    return 0


def to_json(doc):
    """inf/nan made JSON-safe at every depth (bench_serving.json_safe does one dict), paths relative to the checkout."""
    if isinstance(doc, dict):
        return json_safe({k: to_json(v) for k, v in doc.items()})
    if isinstance(doc, (list, tuple)):
        return [to_json(v) for v in doc]
    if isinstance(doc, float) and not math.isfinite(doc):
        return json_safe({"v": doc})["v"]
    if isinstance(doc, (str, Path)):  # no local paths in a data file: the checkout's own are made relative
        text = str(doc).replace(f"{REPO}/", "")
        return "." if text == str(REPO) else text
    return doc


if __name__ == "__main__":
    sys.exit(main())
