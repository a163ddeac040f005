"""Soak test for a running OpenAI-compatible server: a steady Poisson load for a while, watching for errors and leaks.

    python benchmarks/serving/soak_serving.py --serve roseinfer --rate 16 --duration 600 --json soak.json
    python benchmarks/serving/soak_serving.py --base-url http://127.0.0.1:8000/v1 --rate 2 --duration 600 --pid 12345
    python benchmarks/serving/soak_serving.py --rate 1 --duration 40 --metrics-url http://127.0.0.1:8000/metrics

With `--serve ENGINE` it starts that server itself (serving_peers.py: a free loopback port, --model-dir,
--threads, --kv-cache-mib), samples the memory of the server's whole process group, scrapes its /metrics at the
end if it has one, and stops it. Otherwise start the server yourself and point this at it. Only loopback URLs
(127.0.0.1 or localhost) are accepted, so a soak can never be aimed at someone else's server by mistake.

A benchmark asks "how fast"; a soak asks "does it stay healthy". Requests arrive as a Poisson process at
`--rate` per second for `--duration` seconds (the request code is benchmarks/serving/bench_serving.py's), and we count
every request that fails (non-200, broken stream, exception, timeout). With `--pid` (or `--serve`) we read the
server's resident memory (VmRSS in /proc/<pid>/status) every `--rss-every` s: memory that keeps growing under a
steady load is a leak (requests, KV blocks or buffers never freed). The verdict is a straight line fitted (least
squares) to the samples of the last 80% of the run: the first 20% is left to allocator pools and buffers that
grow to the largest batch once. The RSS is "flat" when the line's slope is at most `--max-rss-slope` MiB per
minute (default 1: 8 MiB over the last 8 minutes of a 10-minute soak). Also printed: the growth from the first
sample after a warm-up (60 s or 10% of the duration, whichever is smaller) to the end. With `--metrics-url` we
scrape the server's Prometheus metrics at the end and show the lines about KV blocks and request counts: after
the load has drained, nothing should be left running or held.

A progress line every 30 s; at the end a summary, and exit status 1 if any request failed or the RSS was not flat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from benchmarks.common import free_port, percentile
from benchmarks.serving.bench_serving import (
    RequestResult,
    error_hint,
    get_default_model,
    json_safe,
    make_client,
    make_prompt,
    send_request,
)
from benchmarks.serving.serving_model import model_dir
from benchmarks.serving.serving_peers import BUNDLED, ENGINES, REPO, Server, ServerConfig, group_members, server_spec

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
PROGRESS_EVERY_S = 30.0
FIT_FROM = 0.2  # the RSS slope is fitted to the samples after this share of the run


def check_loopback(url: str, flag: str) -> None:
    """Refuse any URL whose host is not this machine's loopback."""
    host = urlparse(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise SystemExit(
            f"{flag} {url!r}: host {host!r} is not loopback; the soak test only targets 127.0.0.1/localhost"
        )


def read_rss_mib(pid: int) -> float | None:
    """The process's resident set size (VmRSS) in MiB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # reported in kB
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def read_group_rss_mib(pgid: int) -> float | None:
    """The summed VmRSS of every process in group `pgid` (vLLM's server is three processes), or None if none."""
    sizes = [m for pid in group_members(pgid) if (m := read_rss_mib(pid)) is not None]
    return sum(sizes) if sizes else None


async def sample_rss(read, every: float, start: float, samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """Append (elapsed s, read()) every `every` s until `stop` is set."""
    while not stop.is_set():
        rss = read()
        if rss is not None:
            samples.append((time.perf_counter() - start, rss))
        with contextlib.suppress(asyncio.TimeoutError):  # woken by the timeout or by stop
            await asyncio.wait_for(stop.wait(), every)


def rss_slope(samples: list[tuple[float, float]], fit_from: float = FIT_FROM) -> tuple[float, float] | None:
    """The least-squares slope, in MiB per minute, of the samples taken after `fit_from` of the run, and the
    time it starts from. None with fewer than 3 such samples (too few to fit a line worth a verdict)."""
    if not samples:
        return None
    t0 = fit_from * samples[-1][0]
    fit = [(t, m) for t, m in samples if t >= t0]
    if len(fit) < 3:
        return None
    mt = sum(t for t, _ in fit) / len(fit)
    mm = sum(m for _, m in fit) / len(fit)
    var = sum((t - mt) ** 2 for t, _ in fit)
    if var == 0:
        return None
    return sum((t - mt) * (m - mm) for t, m in fit) / var * 60.0, t0


def scrape_metrics(url: str) -> list[str]:
    """The Prometheus sample lines whose metric name mentions kv_cache or num_requests."""
    resp = httpx.get(url, timeout=30.0)
    resp.raise_for_status()
    keep = []
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if "kv_cache" in name or "num_requests" in name:
            keep.append(line)
    return keep


async def soak(args: argparse.Namespace, model: str) -> dict:
    """Send Poisson arrivals for args.duration seconds, then wait for the stragglers; return the summary."""
    arrival_rng = random.Random(args.seed)  # the gaps, as in bench_serving.run_benchmark
    prompt_rng = random.Random(args.seed + 1)  # the prompts, drawn one by one since we do not know how many
    results: list[RequestResult] = []
    sent = 0
    rss: list[tuple[float, float]] = []
    stop = asyncio.Event()
    start = time.perf_counter()
    sampler: asyncio.Task[None] | None = None
    read = None
    if args.pgid is not None:
        read = lambda: read_group_rss_mib(args.pgid)  # noqa: E731
    elif args.pid is not None:
        read = lambda: read_rss_mib(args.pid)  # noqa: E731
    if read is not None:
        sampler = asyncio.create_task(sample_rss(read, args.rss_every, start, rss, stop))

    def progress() -> str:
        errors = sum(not r.ok for r in results)
        mem = f"{rss[-1][1]:.1f}" if rss else "-"
        elapsed = time.perf_counter() - start
        return f"[{elapsed:6.0f} s] sent {sent:5d}  done {len(results):5d}  errors {errors:3d}  RSS {mem} MiB"

    async def reporter() -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), PROGRESS_EVERY_S)
            except asyncio.TimeoutError:
                print(progress(), flush=True)

    report_task = asyncio.create_task(reporter())
    async with make_client() as client:

        async def one(prompt: str | list[int], max_tokens: int) -> None:
            res = await send_request(client, args.base_url, model, prompt, max_tokens, args.timeout, args.ignore_eos)
            results.append(res)

        tasks: list[asyncio.Task[None]] = []
        next_at = 0.0
        while next_at < args.duration:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = make_prompt(prompt_rng, prompt_rng.randint(*args.input_len), "text")
            tasks.append(asyncio.create_task(one(prompt, prompt_rng.randint(*args.output_len))))
            sent += 1
            next_at += arrival_rng.expovariate(args.rate)
        send_end = time.perf_counter() - start
        await asyncio.gather(*tasks)  # each bounded by --timeout
    elapsed = time.perf_counter() - start
    if read is not None and (end_rss := read()) is not None:
        rss.append((elapsed, end_rss))
    stop.set()
    await report_task
    if sampler is not None:
        await sampler

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    e2e = sorted(r.latency * 1e3 for r in results if r.ok)
    ttft = sorted(r.ttft * 1e3 for r in results if r.ok and r.ttft is not None)
    summary: dict = {
        "base_url": args.base_url,
        "model": model,
        "rate": args.rate,
        "duration_s": args.duration,
        "send_window_s": send_end,
        "elapsed_s": elapsed,
        "requests": len(results),
        "successes": len(results) - sum(errors.values()),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "output_tokens": sum(r.output_tokens for r in results if r.ok),
        "p50_ttft_ms": percentile(ttft, 50),
        "p99_ttft_ms": percentile(ttft, 99),
        "p50_e2e_ms": percentile(e2e, 50),
        "p99_e2e_ms": percentile(e2e, 99),
        "rss_samples": [(round(t, 1), round(m, 1)) for t, m in rss],
    }
    if rss:
        warmup = min(60.0, 0.1 * args.duration)
        after = [m for t, m in rss if t >= warmup]
        base = after[0] if after else rss[0][1]
        summary.update(
            warmup_s=warmup,
            rss_start_mib=rss[0][1],
            rss_max_mib=max(m for _, m in rss),
            rss_end_mib=rss[-1][1],
            rss_after_warmup_mib=base,
            rss_growth_mib=rss[-1][1] - base,
        )
        if fitted := rss_slope(rss):
            slope, t0 = fitted
            summary.update(rss_fit_from_s=t0, rss_slope_mib_per_min=slope, rss_max_slope_mib_per_min=args.max_rss_slope,
                           rss_flat=slope <= args.max_rss_slope)  # fmt: skip
    return summary


def print_summary(s: dict) -> None:
    rows = [
        ("base url", s["base_url"]),
        ("model", s["model"]),
        ("rate (req/s) x duration (s)", f"{s['rate']:g} x {s['duration_s']:g}"),
        ("elapsed (s)", f"{s['elapsed_s']:.1f}"),
        ("total requests", s["requests"]),
        ("errors", s["errors"]),
        ("output tokens", s["output_tokens"]),
        ("TTFT p50 / p99 (ms)", f"{s['p50_ttft_ms']:.1f} / {s['p99_ttft_ms']:.1f}"),
        ("E2E  p50 / p99 (ms)", f"{s['p50_e2e_ms']:.1f} / {s['p99_e2e_ms']:.1f}"),
    ]
    if "rss_start_mib" in s:
        rows += [
            (
                "RSS start / max / end (MiB)",
                f"{s['rss_start_mib']:.1f} / {s['rss_max_mib']:.1f} / {s['rss_end_mib']:.1f}",
            ),
            (f"RSS growth after {s['warmup_s']:g} s warm-up", f"{s['rss_growth_mib']:+.1f} MiB"),
        ]
        if "rss_slope_mib_per_min" in s:
            verdict = "flat" if s["rss_flat"] else "GROWING"
            rows.append((f"RSS slope after {s['rss_fit_from_s']:.0f} s",
                         f"{s['rss_slope_mib_per_min']:+.2f} MiB/min: {verdict} (bound "
                         f"{s['rss_max_slope_mib_per_min']:g} MiB/min)"))  # fmt: skip
        else:
            rows.append(("RSS slope", "too few samples to fit (a longer run, or a smaller --rss-every)"))
    else:
        rows.append(("RSS", "not sampled (pass --pid or --serve)"))
    for error, count in s["error_kinds"].items():
        rows.append((f"error x{count}", error[:200]))
    if hint := error_hint(s["error_kinds"]):
        rows.append(("hint", hint))
    width = max(len(name) for name, _ in rows)
    rule = "=" * (width + 30)
    print(rule)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(rule)


def run(args: argparse.Namespace) -> int:
    """The soak against args.base_url, its summary printed (and written to --json); the exit status."""
    model = args.model or get_default_model(args.base_url)
    print(f"soak: {args.rate:g} req/s for {args.duration:g} s against {args.base_url} (model {model})", flush=True)
    summary = asyncio.run(soak(args, model))
    print_summary(summary)

    if args.metrics_url:
        try:
            lines = scrape_metrics(args.metrics_url)
            summary["metrics"] = lines
            print(f"metrics from {args.metrics_url} (kv_cache, num_requests):")
            for line in lines or ["  (no such lines)"]:
                print(f"  {line}")
        except httpx.HTTPError as e:
            summary["metrics_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"could not scrape {args.metrics_url}: {summary['metrics_error']}")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if summary["errors"] or summary.get("rss_flat") is False else 0


def serve_and_run(args: argparse.Namespace) -> int:
    """Start args.serve on a free loopback port, soak it (RSS of its whole process group), stop it."""
    cfg = ServerConfig(args.model_dir, threads=args.threads, kv_cache_bytes=args.kv_cache_mib * 2**20)
    port = free_port()
    spec = server_spec(args.serve, port, cfg)
    with Server(spec, port, REPO / "results" / "serving-logs" / f"soak-{args.serve}.log") as server:
        print(f"started {spec.version} on {server.base_url} in {server.startup_s:.0f} s (process group "
              f"{server.proc.pid})", flush=True)  # fmt: skip
        args.base_url, args.model, args.pgid = server.base_url, spec.model, server.proc.pid
        args.ignore_eos = args.ignore_eos and spec.ignore_eos
        if args.serve == "roseinfer":
            args.metrics_url = args.metrics_url or f"http://127.0.0.1:{port}/metrics"
        return run(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="model name sent in requests (default: first of GET /models)")
    ap.add_argument("--serve", choices=ENGINES, default=None, help="start this server, soak it, stop it")
    ap.add_argument("--model-dir", type=model_dir, default=BUNDLED, help="with --serve: a directory, or smollm2-135m")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="with --serve")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="with --serve: the server's KV pool")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson arrivals)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of sending")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="leave ignore_eos out")
    ap.add_argument("--pid", type=int, default=None, help="server pid: sample its VmRSS every --rss-every s")
    ap.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--max-rss-slope", type=float, default=1.0, help="MiB/min over the last 80%% still called flat")
    ap.add_argument("--metrics-url", default=None, help="Prometheus endpoint to scrape at the end")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()
    args.pgid = None
    if not (args.rate > 0 and math.isfinite(args.rate)):
        ap.error("--rate must be a finite number > 0")
    if not (args.duration > 0 and args.rss_every > 0):
        ap.error("--duration and --rss-every must be > 0")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")
    if args.serve:
        if args.pid is not None:
            ap.error("--serve samples the server it starts: leave --pid out")
        return serve_and_run(args)
    check_loopback(args.base_url, "--base-url")
    if args.metrics_url:
        check_loopback(args.metrics_url, "--metrics-url")
    if args.pid is not None and read_rss_mib(args.pid) is None:
        ap.error(f"--pid {args.pid}: no such process (or no VmRSS in /proc/{args.pid}/status)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
