"""One offered request rate held for a fixed time, and the rule that says whether a server sustains it.

Why not a fixed number of requests: 200 requests at 24 req/s are 8 s of arrivals. A server that falls behind
by 10% builds a queue of less than a second in that time, which barely shows in p99 TTFT; held for a minute, the
same deficit is a queue of six seconds. A rate is judged on a window of time, long enough for a queue to grow.

One rate, in time from the first arrival (open loop: arrivals follow the schedule whatever the server does):

    0           W                          T                   T + grace
    |-- fill ---|------- measured ---------|------ drain -------| cut
    ^ ^^  ^ ^  ^^ ^  ^^^ ^  ^ ^  ^^  ^ ^   |   (no arrivals after T)
    Poisson arrivals at rate r, gaps ~ Exp(r)

- Measured requests: the ones that ARRIVE in [W, T). The first W seconds (default 10% of T) only fill the
  server (running batch, queues, allocator pools); their requests load it but are not counted.
- Offered output load: the tokens the measured requests ask for / (T - W), in tok/s: max_tokens each, or the
  tokens it got for a request that completed early at an end-of-sequence token (the server owed no more; only
  servers that refuse `ignore_eos` do that, and the rows count such requests as "short"). Offered req/s is
  their number / (T - W), the nominal rate up to Poisson noise.
- Achieved output throughput: the tokens the server streamed back during [W, T), to any request, / (T - W).
  At a steady state what flows out is what flows in, so achieved = offered; a server that cannot keep up builds
  a queue and streams at its capacity, below the offered load. (Tokens / time until the last request finished
  would charge every run one end-to-end latency of draining and fail a server that keeps up with long outputs.)
  Tokens are placed in time by their text chunks: a completed request's usage.completion_tokens spread over its
  chunks, one token per chunk for a request that did not complete.
- After T nothing is sent; requests in flight may finish until T + grace, then they are cut: the stream is
  closed, which aborts the request in the server. A cut request is counted as cut, not as failed; if it never
  got a first token it enters the TTFT percentiles with T + grace - arrival, a lower bound of its real TTFT,
  so that a run cannot look good by leaving its slowest requests out.
- Latency percentiles are over the measured requests: TTFT (with the cut ones as above), TPOT, ITL and E2E over
  the completed ones. Failed requests (an HTTP error, a broken stream) are counted apart.

Sustained, all three must hold (`Criteria`; the bound is part of every result):

    achieved output tok/s >= min_ratio x offered output tok/s      (default 0.95)
    p99 TTFT <= max_p99_ttft_ms                                    (default 2000 ms)
    failed requests <= max_failed_frac x measured requests         (default 0: one failure fails the rate)

Capacity: the highest measured rate r such that every measured rate <= r is sustained (a noisy pass above a
failure is reported, not believed). `next_rate` picks the next rate to try so that capacity gets bracketed
and then narrowed: twice the highest rate if all passed, half the lowest if none did, else the midpoint of
the bracket until hi / lo <= 1 + resolution; `sweep` runs that search with a function that measures one rate,
such as `hold_rate` (one window judged, then a probe that waits until the server is idle again).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.common import percentile
from benchmarks.serving.bench_serving import RequestResult, make_client, make_prompt, send_request


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths (uniform, inclusive) and the seed of the arrivals and the prompts."""

    input_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 64)
    seed: int = 0
    prompt_kind: str = "text"


@dataclass(frozen=True)
class Criteria:
    """When a rate counts as sustained."""

    min_ratio: float = 0.95
    max_p99_ttft_ms: float = 2000.0
    max_failed_frac: float = 0.0

    def describe(self) -> str:
        return (f"achieved output tok/s >= {self.min_ratio:.0%} of offered AND p99 TTFT <= {self.max_p99_ttft_ms:g} ms "
                f"AND failed requests <= {self.max_failed_frac:.1%}")  # fmt: skip


@dataclass
class Sent:
    """One request of a window: when it arrived (s from the first arrival), what it asked for, what it got."""

    arrival: float
    max_tokens: int
    result: RequestResult

    @property
    def cut(self) -> bool:  # still running at the deadline (send_request's timeout is the time left to it)
        return not self.result.ok and self.result.error.startswith("timeout")

    @property
    def failed(self) -> bool:
        return not self.result.ok and not self.cut

    def chunk_times(self) -> list[float]:
        """Arrival times (s from the first arrival) of the text chunks: TTFT, then the gaps."""
        r = self.result
        if r.ttft is None:
            return []
        times = [self.arrival + r.ttft]
        for gap in r.itl:
            times.append(times[-1] + gap)
        return times

    def asked(self) -> int:
        """The tokens this request asked for: max_tokens, or what it got if it completed early (EOS)."""
        return min(self.max_tokens, self.result.output_tokens) if self.result.ok else self.max_tokens

    def tokens_per_chunk(self) -> float:
        n = 1 + len(self.result.itl) if self.result.ttft is not None else 0
        return self.result.output_tokens / n if self.result.ok and n else 1.0


async def run_window(base_url: str, model: str, rate: float, duration: float, grace: float, workload: Workload,
                     ignore_eos: bool = True) -> list[Sent]:  # fmt: skip
    """Send Poisson arrivals at `rate` for `duration` s, let them finish until duration + grace, cut the rest.

    The gaps are Random(seed).expovariate(rate): the same unit-exponential draws for every rate and server, so a
    higher rate is the same schedule compressed. Prompts and lengths come from Random(seed + 1) in order: the k-th
    request is the same everywhere.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    gaps, draws = random.Random(workload.seed), random.Random(workload.seed + 1)
    sent: list[tuple[float, int, asyncio.Task[RequestResult]]] = []
    async with make_client() as client:
        start = time.perf_counter()
        deadline = start + duration + grace
        next_at = 0.0
        while next_at < duration:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = make_prompt(draws, draws.randint(*workload.input_len), workload.prompt_kind)
            max_tokens = draws.randint(*workload.output_len)
            left = deadline - time.perf_counter()
            task = asyncio.create_task(send_request(client, base_url, model, prompt, max_tokens, left, ignore_eos,
                                                    created=time.perf_counter()))  # fmt: skip
            sent.append((time.perf_counter() - start, max_tokens, task))
            next_at += gaps.expovariate(rate)
        results = await asyncio.gather(*(task for _, _, task in sent))
    return [Sent(arrival, n, res) for (arrival, n, _), res in zip(sent, results, strict=True)]


def window_row(sent: list[Sent], rate: float, duration: float, warmup: float, grace: float) -> dict:
    """The numbers of one window (times in ms, throughputs per second of the measured part [warmup, duration))."""
    if not 0 <= warmup < duration:
        raise ValueError(f"warmup must be in [0, duration): {warmup} vs {duration}")
    span = duration - warmup
    measured = [s for s in sent if warmup <= s.arrival < duration]
    streamed = sum(s.tokens_per_chunk() for s in sent for t in s.chunk_times() if warmup <= t < duration)
    done = [s for s in measured if s.result.ok]
    ttft = [s.result.ttft for s in measured if s.result.ttft is not None and not s.failed]
    ttft += [duration + grace - s.arrival for s in measured if s.cut and s.result.ttft is None]  # lower bounds
    tpot = [(s.result.latency - s.result.ttft) / (s.result.output_tokens - 1)
            for s in done if s.result.ttft is not None and s.result.output_tokens > 1]  # fmt: skip
    itl = [g for s in measured if not s.failed for g in s.result.itl]
    e2e = [s.result.latency for s in done]
    ends = [s.arrival + s.result.latency for s in sent]
    offered = sum(s.asked() for s in measured) / span
    row: dict = {
        "rate": rate,
        "duration_s": duration,
        "warmup_s": warmup,
        "grace_s": grace,
        "sent": len(sent),
        "measured": len(measured),
        "completed": len(done),
        "failed": sum(s.failed for s in measured),
        "cut": sum(s.cut for s in measured),
        "cut_without_first_token": sum(s.cut and s.result.ttft is None for s in measured),
        "short": sum(s.result.output_tokens < s.max_tokens for s in done),  # ended before max_tokens (EOS)
        "offered_req_s": len(measured) / span,
        "offered_output_tok_s": offered,
        "achieved_output_tok_s": streamed / span,
        "achieved_ratio": streamed / span / offered if offered else math.nan,
        "drain_s": max(0.0, max(ends, default=duration) - duration),  # from the window's end to the last response
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        ordered = sorted(v * 1e3 for v in values)
        for q in (50, 90, 99):
            row[f"p{q}_{name}_ms"] = percentile(ordered, q)
    errors: dict[str, int] = {}
    for s in measured:
        if s.failed:
            errors[s.result.error] = errors.get(s.result.error, 0) + 1
    row["errors"] = errors
    return row


def judge(row: dict, criteria: Criteria) -> list[str]:
    """Why `row` is not sustained under `criteria`: an empty list when it is."""
    reasons = []
    ratio = row["achieved_ratio"]
    if not ratio >= criteria.min_ratio:  # a NaN ratio (nothing measured) fails too
        reasons.append(f"achieved {row['achieved_output_tok_s']:.1f} < {criteria.min_ratio:.0%} of offered "
                       f"{row['offered_output_tok_s']:.1f} tok/s")  # fmt: skip
    if not row["p99_ttft_ms"] <= criteria.max_p99_ttft_ms:
        reasons.append(f"p99 TTFT {row['p99_ttft_ms']:.0f} ms > {criteria.max_p99_ttft_ms:g} ms")
    if row["failed"] > criteria.max_failed_frac * row["measured"]:
        reasons.append(f"{row['failed']} of {row['measured']} requests failed")
    if not row["measured"]:
        reasons.append("no request arrived in the measured part of the window")
    return reasons


def capacity(rows: list[dict]) -> dict:
    """Capacity from rows that carry "rate" and "sustained": the highest rate below the first unsustained one.

    Returns capacity_req_s (None: not even the lowest rate held), first_unsustained_req_s (None: every rate
    held, capacity is at least the highest one), highest_sustained_req_s and monotone (False when some rate
    above a failure passed: noise, or a server that recovers)."""
    ordered = sorted(rows, key=lambda r: (r["rate"], r["sustained"]))  # a failed repeat of a rate sorts first
    cap = first_bad = None
    for r in ordered:
        if not r["sustained"]:
            first_bad = r["rate"]
            break
        cap = r["rate"]
    highest = max((r["rate"] for r in rows if r["sustained"]), default=None)
    return {"capacity_req_s": cap, "first_unsustained_req_s": first_bad, "highest_sustained_req_s": highest,
            "monotone": highest == cap}  # fmt: skip


def round_rate(x: float) -> float:
    """Two significant digits: 23.4 -> 23, 2.75 -> 2.8."""
    return float(f"{x:.2g}")


def next_rate(rows: list[dict], resolution: float = 0.1) -> float | None:
    """The next rate to measure to bracket and narrow capacity, or None when hi / lo <= 1 + resolution."""
    if not rows:
        raise ValueError("next_rate needs at least one measured rate")
    c = capacity(rows)
    lo, hi = c["capacity_req_s"], c["first_unsustained_req_s"]
    if hi is None:
        return round_rate(2 * lo)
    if lo is None:
        return round_rate(hi / 2)
    mid = round_rate((lo + hi) / 2)
    if hi <= lo * (1 + resolution) or not lo < mid < hi:
        return None
    return mid


def sweep(measure: Callable[[float], dict], rates: list[float], search_steps: int, resolution: float = 0.1,
          full_sweep: bool = False, rows: list[dict] | None = None) -> list[dict]:  # fmt: skip
    """Measure `rates` upwards until one is not sustained (every one with `full_sweep`), then up to `search_steps`
    more rates that `next_rate` picks. `measure(rate)` returns a row with "rate" and "sustained"; each row is
    appended to `rows` (returned) as soon as it is measured, so a caller whose `measure` raises keeps the others."""
    rows = [] if rows is None else rows
    for rate in sorted(rates):
        rows.append(measure(rate))
        if not rows[-1]["sustained"] and not full_sweep:
            break
    for _ in range(search_steps):
        rate = next_rate(rows, resolution)
        if rate is None or any(r["rate"] == rate for r in rows):
            break
        rows.append(measure(rate))
    return rows


async def probe(base_url: str, model: str, timeout: float) -> float:
    """One 4-token request; returns its latency. It waits behind whatever the server still has queued."""
    async with make_client() as client:
        res = await send_request(client, base_url, model, "the king", 4, timeout, ignore_eos=False)
    if not res.ok:
        raise RuntimeError(f"probe request failed: {res.error}")
    return res.latency


def warm_up(base_url: str, model: str, workload: Workload, ignore_eos: bool = True, what: str = "the server") -> None:
    """Two seconds at 4 req/s (buffers, allocator pools, the first batches); RuntimeError if a request fails."""
    warm = asyncio.run(run_window(base_url, model, 4.0, 2.0, 60.0, workload, ignore_eos))
    if bad := [s.result.error for s in warm if not s.result.ok]:
        raise RuntimeError(f"{what}: warm-up requests failed: {bad[:3]}")


def hold_rate(base_url: str, model: str, rate: float, duration: float, warmup_frac: float, grace: float,
              settle_timeout: float, workload: Workload, criteria: Criteria,
              ignore_eos: bool = True) -> dict:  # fmt: skip
    """One window at `rate` (`window_row`, its first `warmup_frac` not measured), judged ("why_not", "sustained"),
    then a probe that waits until the server is idle again ("settle_s"; RuntimeError if it fails: a wedged server)."""
    load = os.getloadavg()[0]
    sent = asyncio.run(run_window(base_url, model, rate, duration, grace, workload, ignore_eos))
    row = window_row(sent, rate, duration, warmup_frac * duration, grace)
    row["settle_s"] = asyncio.run(probe(base_url, model, settle_timeout))
    row["loadavg_at_start"] = load
    row["why_not"] = judge(row, criteria)
    row["sustained"] = not row["why_not"]
    return row
