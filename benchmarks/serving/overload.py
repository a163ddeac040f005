"""Overload: offer `roseinfer serve` three times what it sustains, and check that it holds.

    python benchmarks/serving/overload.py --threads 2 --factor 3 --duration 120 --json overload.json
    python benchmarks/serving/overload.py --capacity 36 --duration 30          # capacity known: no sweep

A server that holds under overload refuses what it cannot queue, fast and politely, and serves the rest:

    1. start `roseinfer serve` on the bundled model (serving_peers.py: --threads, the KV pool, the batch caps, as
       serving_capacity.py starts it) and warm it up
    2. capacity C: --capacity, or measured as serving_capacity.py does (serving_window.py: --rates swept upwards,
       --capacity-duration s each, the same "sustained" rule), only shorter
    3. before: C held for --check-duration s                                  (what full rate looks like)
    4. overload: Poisson arrivals at --factor x C for --duration s, open loop, the workload of
       serving_capacity.py (streamed completions, prompts and lengths from one seed); then --grace s for the
       requests in flight, after which the rest are cut (their streams closed: the server aborts them)
    5. settle: /metrics polled until it shows 0 running, 0 waiting and every KV block free
       (vllm:kv_cache_usage_perc 0), at most --settle-timeout s
    6. after: C held again for --check-duration s                            (does it serve at full rate again?)

From step 3 to step 6 a separate process (poller.py) GETs /health and /metrics every 50 ms on its own
connections and records each latency: a health check that stalls behind the engine gets a busy replica taken
out of rotation. Each overload answer is counted by status code; a 503 with `Retry-After` (the bounded queue,
--max-waiting, saying "come back later") apart from one without. The checks:

    no 5xx but 503          every answer is a 200 or the bounded queue's 503
    503 says when           every 503 carries Retry-After
    no broken stream        no stream ends in an error event, no request goes unanswered (a cut is not a failure)
    back to zero            the gauges reach 0 running, 0 waiting, KV usage 0 after the load
    full rate again         the "after" window streams >= --min-ratio (95%) of the "before" window's tokens/s
                            (the same seeded requests at the same rate) and none of its requests fails

The load generator shares the machine with the server: at 3x capacity it costs the server CPU time, which the
numbers include. The JSON (--json) holds every number: the command line, the CPU model, the settings, the
capacity rows, the before / overload / after windows, the status counts, the /health and /metrics latencies
(p50 / p99 / max per phase), the gauges, and the checks. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.common import REPO, free_port, percentile
from benchmarks.serving.poller import gauges
from benchmarks.serving.serving_capacity import environment, format_row, to_json
from benchmarks.serving.serving_model import model_dir
from benchmarks.serving.serving_peers import BUNDLED, Server, ServerConfig, server_spec
from benchmarks.serving.serving_window import (
    Criteria,
    Sent,
    Workload,
    capacity,
    hold_rate,
    run_window,
    sweep,
    warm_up,
    window_row,
)

PHASES = ("before", "overload", "settle", "after")


def count_statuses(sent: list[Sent]) -> dict:
    """The overload's answers: by HTTP status, 503s with and without Retry-After, streams that ended in an error
    event, requests with no answer at all, and requests cut at the end of the grace (the client gave up)."""
    by_status: dict[str, int] = {}
    out = {"by_status": by_status, "503_with_retry_after": 0, "503_without_retry_after": 0, "stream_errors": 0,
           "no_answer": 0, "cut": 0}  # fmt: skip
    for s in sent:
        r = s.result
        if r.status is not None:
            by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
        if r.status == 503:
            out["503_with_retry_after" if r.retry_after else "503_without_retry_after"] += 1
        if s.cut:
            out["cut"] += 1
        elif r.status is None:
            out["no_answer"] += 1
        elif r.status == 200 and not r.ok:
            out["stream_errors"] += 1
    out["other_5xx"] = sum(n for code, n in by_status.items() if code.startswith("5") and code != "503")
    return out


def first_token_wait(sent: list[Sent]) -> dict:
    """Where the overload's answered requests waited for their first token, p50 / p99 ms of each part: in the load
    generator (made, not yet sent: its event loop was busy), from sending to the response's headers (connecting,
    the server's HTTP layer, up to the handler admitting it: a 200 starts its stream then), and from the headers to
    the first token (the engine's queue and the prefill); and for the refused ones, sending to the 503."""
    done = [s.result for s in sent if s.result.status == 200 and s.result.ttft is not None and s.result.headers]
    refused = [s.result.headers for s in sent if s.result.status == 503 and s.result.headers is not None]
    parts = {"in_client": [r.send_time - r.created for r in done], "to_headers": [r.headers for r in done],
             "headers_to_first_token": [r.ttft - r.headers for r in done], "to_503": refused}  # fmt: skip
    out: dict = {"requests": len(done), "refused": len(refused)}
    for name, values in parts.items():
        ms = sorted(v * 1e3 for v in values)
        out[name] = {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
    return out


def latency_summary(samples: list[list], start: float, end: float) -> dict:
    """count, failed (not a 200), p50 / p99 / max ms of the samples sent in [start, end)."""
    inside = [s for s in samples if start <= s[0] < end]
    ms = sorted(s[1] for s in inside)
    return {"count": len(inside), "failed": sum(s[2] != 200 for s in inside), "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms, default=None)}  # fmt: skip


def poll_summary(samples: dict, bounds: dict[str, tuple[float, float]]) -> dict:
    """Per path and phase, the latencies; and the highest gauges /metrics showed during the overload."""
    out = {path: {phase: latency_summary(samples[path], *bounds[phase]) for phase in bounds}
           for path in ("health", "metrics")}  # fmt: skip
    start, end = bounds["overload"]
    during = [s for s in samples["metrics"] if start <= s[0] < end and s[2] == 200]
    out["peak_during_overload"] = {name: max((s[3 + i] for s in during if s[3 + i] is not None), default=None)
                                   for i, name in enumerate(("running", "waiting", "kv_cache_usage_perc"))}  # fmt: skip
    sockets = [s for s in samples.get("sockets", []) if start <= s[0] < end]
    out["peak_during_overload"] |= {"accept_queue": max((s[1] for s in sockets), default=None),
                                    "established": max((s[2] for s in sockets), default=None)}  # fmt: skip
    return out


def settle(server_url: str, timeout: float) -> dict:
    """Poll /metrics until 0 running, 0 waiting and KV usage 0, or `timeout` s; the last gauges and the time."""
    t0 = time.perf_counter()
    while True:
        now = gauges(httpx.get(server_url + "/metrics", timeout=30).text)
        zero = now["running"] == 0 and now["waiting"] == 0 and now["kv_cache_usage_perc"] == 0
        if zero or time.perf_counter() - t0 > timeout:
            return {"gauges": now, "zero": zero, "seconds": time.perf_counter() - t0}
        time.sleep(0.1)


class Poller:
    """poller.py in its own process, from `with` to the end of the block; `.samples` afterwards."""

    def __init__(self, server_url: str, every: float):
        self.cmd = [sys.executable, "-m", "benchmarks.serving.poller", server_url, "--every", str(every)]
        self.samples: dict = {}

    def __enter__(self) -> Poller:
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(timeout=60)  # closes its stdin: it stops and prints its samples
        if self.proc.returncode != 0:
            raise RuntimeError(f"the poller ({' '.join(self.cmd)}) exited with {self.proc.returncode}")
        self.samples = json.loads(out)


def measure_capacity(base_url: str, model: str, args, wl: Workload, crit: Criteria) -> tuple[float, list[dict]]:
    """--capacity, or the highest sustained rate of a short sweep (serving_window.sweep); and the sweep's rows."""
    if args.capacity is not None:
        return args.capacity, []

    def measure(rate: float) -> dict:
        row = hold_rate(base_url, model, rate, args.capacity_duration, args.warmup_frac, args.grace,
                        args.settle_timeout, wl, crit)  # fmt: skip
        print(format_row("capacity", row), flush=True)
        return row

    rows = sweep(measure, args.rates, args.search_steps, args.resolution)
    cap = capacity(rows)["capacity_req_s"]
    if cap is None:
        raise SystemExit(f"not even {min(args.rates):g} req/s was sustained: pass lower --rates, or --capacity")
    return cap, rows


def run(args) -> dict:
    """Steps 1 to 6; the record."""
    cfg = ServerConfig(args.model_dir, args.threads, args.kv_cache_mib * 2**20, args.max_num_seqs,
                       args.max_num_batched_tokens, args.max_model_len)  # fmt: skip
    port = free_port()
    spec = server_spec("roseinfer", port, cfg)
    if args.max_waiting is not None:
        spec = replace(spec, cmd=[*spec.cmd, "--max-waiting", str(args.max_waiting)])
    wl = Workload(tuple(args.input_len), tuple(args.output_len), args.seed)
    crit = Criteria(args.min_ratio, args.max_p99_ttft_ms)
    record: dict = {"command": ["python", "benchmarks/serving/overload.py", *args.argv],
                    "environment": environment(cfg), "settings": {k: v for k, v in vars(args).items() if k != "argv"},
                    "server": {"command": spec.cmd, "version": spec.version, "kv": spec.kv}}  # fmt: skip
    with Server(spec, port, args.log) as server:
        url, model = f"http://127.0.0.1:{port}", spec.model
        record["server"]["startup_s"] = server.startup_s
        print(f"{spec.version} up in {server.startup_s:.0f} s on {url}", flush=True)
        warm_up(server.base_url, model, wl)
        cap, rows = measure_capacity(server.base_url, model, args, wl, crit)
        record["capacity"] = {"req_s": cap, "measured": args.capacity is None, "rows": rows}
        check = (server.base_url, model, cap, args.check_duration, args.warmup_frac, args.grace, args.settle_timeout,
                 wl, crit)  # fmt: skip
        bounds = {}
        with Poller(url, args.poll_every) as poller:
            t = time.monotonic()
            record["before"] = hold_rate(*check)
            print(format_row("before", record["before"]), flush=True)
            bounds["before"] = (t, t := time.monotonic())
            rate = args.factor * cap
            print(f"overload: {rate:g} req/s ({args.factor:g} x {cap:g}) for {args.duration:g} s", flush=True)
            sent = asyncio.run(run_window(server.base_url, model, rate, args.duration, args.grace, wl))
            bounds["overload"] = (t, t := time.monotonic())
            row = window_row(sent, rate, args.duration, 0.0, args.grace)
            row["errors"] = {e: n for e, n in row["errors"].items() if not e.startswith("RuntimeError: HTTP 503")}
            record["overload"] = {"rate": rate, "factor": args.factor, "statuses": count_statuses(sent), "row": row,
                                  "first_token_wait": first_token_wait(sent)}  # fmt: skip
            record["settle"] = settle(url, args.settle_timeout)
            bounds["settle"] = (t, t := time.monotonic())
            record["after"] = hold_rate(*check)
            print(format_row("after", record["after"]), flush=True)
            bounds["after"] = (t, time.monotonic())
        record["poll"] = poll_summary(poller.samples, bounds)
    before, after = record["before"]["achieved_output_tok_s"], record["after"]["achieved_output_tok_s"]
    record["after_over_before"] = after / before if before else None
    record["checks"] = checks(record)
    record["holds"] = all(record["checks"].values())
    record["environment"]["loadavg_at_end"] = os.getloadavg()
    return record


def checks(record: dict) -> dict[str, bool]:
    """The verdicts of the module's docstring, by name (a 4xx fails the first too: every request here is valid)."""
    st, g = record["overload"]["statuses"], record["settle"]["gauges"]
    return {
        "no_5xx_but_503": st["other_5xx"] == 0 and all(c in ("200", "503") for c in st["by_status"]),
        "every_503_has_retry_after": st["503_without_retry_after"] == 0,
        "no_broken_stream": st["stream_errors"] == 0 and st["no_answer"] == 0,
        "gauges_back_to_zero": g["running"] == 0 and g["waiting"] == 0,
        "kv_blocks_all_free": g["kv_cache_usage_perc"] == 0,
        "full_rate_again": (record["after_over_before"] or 0.0) >= record["settings"]["min_ratio"]
        and record["after"]["failed"] == 0,
    }


def summary(record: dict) -> str:
    """What the run saw, for a terminal: the load, the answers, the poll latencies per phase, the gauges, the checks."""
    o, st, p, cap = record["overload"], record["overload"]["statuses"], record["poll"], record["capacity"]
    how = "measured" if cap["measured"] else "given"
    lines = [
        f"capacity {cap['req_s']:g} req/s ({how}); overload {o['rate']:g} req/s for {o['row']['duration_s']:g} s: "
        f"{o['row']['sent']} requests sent",
        f"statuses {st['by_status']}: 503 with Retry-After {st['503_with_retry_after']}, without "
        f"{st['503_without_retry_after']}; stream errors {st['stream_errors']}, unanswered {st['no_answer']}, "
        f"cut {st['cut']}",
        f"{'path':9s}{'phase':>9s} {'n':>6s} {'fail':>5s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}",
    ]
    for path in ("health", "metrics"):
        for phase, s in p[path].items():
            nums = " ".join("       -" if s[k] is None else f"{s[k]:8.1f}" for k in ("p50_ms", "p99_ms", "max_ms"))
            lines.append(f"/{path:8s}{phase:>9s} {s['count']:6d} {s['failed']:5d} {nums}")
    wait = o["first_token_wait"]
    lines.append(f"first-token wait of {wait['requests']} answered requests, p50 / p99 ms: " + ", ".join(
        f"{name} {wait[name]['p50_ms'] or 0:.0f} / {wait[name]['p99_ms'] or 0:.0f}"
        for name in ("in_client", "to_headers", "headers_to_first_token", "to_503")))  # fmt: skip
    peak, se = p["peak_during_overload"], record["settle"]
    lines.append(f"peak during overload: {peak}; after it: {se['gauges']} within {se['seconds']:.1f} s")
    for name in ("before", "after"):
        r = record[name]
        lines.append(
            f"{name:6s} achieved {r['achieved_output_tok_s']:.1f} of {r['offered_output_tok_s']:.1f} tok/s, "
            f"p99 TTFT {r['p99_ttft_ms']:.0f} ms: {'sustained' if r['sustained'] else 'NOT sustained'}"
        )
    lines.append(f"after / before: {record['after_over_before'] or 0:.3f} of the output tok/s")
    lines += [f"check {name}: {'ok' if ok else 'FAILED'}" for name, ok in record["checks"].items()]
    return "\n".join(lines + [f"holds: {record['holds']}"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=float, default=None, metavar="REQ_PER_S", help="skip the sweep: this rate")
    ap.add_argument("--factor", type=float, default=3.0, help="the overload, in multiples of the capacity")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of overload arrivals")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds after a window before requests are cut")
    ap.add_argument("--check-duration", type=float, default=20.0, help="seconds of the before and after windows")
    ap.add_argument("--rates", type=float, nargs="+", default=[8, 16, 24, 32, 48], help="the capacity sweep's")
    ap.add_argument("--capacity-duration", type=float, default=20.0, help="seconds per rate of the sweep")
    ap.add_argument("--search-steps", type=int, default=2, help="extra rates to bracket and bisect the capacity")
    ap.add_argument("--resolution", type=float, default=0.1, help="stop bisecting when hi / lo <= 1 + this")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="first share of a window not measured")
    ap.add_argument("--max-p99-ttft-ms", type=float, default=2000.0, help="the latency bound of 'sustained'")
    ap.add_argument("--min-ratio", type=float, default=0.95, help="achieved / offered output tok/s of 'sustained'")
    ap.add_argument("--settle-timeout", type=float, default=120.0, help="seconds for the gauges to reach 0")
    ap.add_argument("--poll-every", type=float, default=0.05, help="seconds between two /health (/metrics) GETs")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=model_dir, default=BUNDLED, help="a directory, or a random shape: smollm2-135m")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-waiting", type=int, default=None, help="the server's queue (default: its own, 1024)")
    ap.add_argument("--log", type=Path, default=REPO / "results" / "serving-logs" / "overload.log")
    ap.add_argument("--json", type=Path, default=None, help="write the record here")
    args = ap.parse_args(argv)
    positive = ("factor", "duration", "check_duration", "capacity_duration", "settle_timeout", "poll_every")
    for name in positive + (("capacity",) if args.capacity is not None else ()):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not (0 <= args.warmup_frac < 1 and args.grace >= 0):
        ap.error("need 0 <= --warmup-frac < 1 and --grace >= 0")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the record
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    print(summary(record), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(record), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if record["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
