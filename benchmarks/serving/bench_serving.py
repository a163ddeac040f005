"""Serving benchmark: stream completions from any OpenAI-compatible server and measure latency as a user sees it.

    python benchmarks/serving/bench_serving.py --base-url http://127.0.0.1:8000/v1 --request-rate 4 --num-requests 64
    python benchmarks/serving/bench_serving.py --request-rate inf --num-requests 8 --json results/serving.json
    python benchmarks/serving/bench_serving.py --model gpt2 --input-len 128 256 --output-len 64 64 --max-concurrency 8

Each request is `POST {base_url}/completions` with `stream: true`, `temperature: 0` and `ignore_eos: true`
(so every request generates exactly `max_tokens` tokens and runs are comparable). The server answers with
server-sent events, one `data: {json}` line per chunk of text, and we time the chunks as they arrive.

What the numbers mean (all per request, then summarised as percentiles over requests):

    TTFT  time to first token: from sending the request to the first chunk that carries text. It is what
          the user waits before anything appears: queueing + prefill of the prompt + one decode step.
    TPOT  time per output token: (end - first token) / (output tokens - 1), the average pace of the
          decode phase once the first token is out. Requests with a single token have no TPOT.
    ITL   inter-token latency: every gap between two consecutive text chunks, pooled over all requests.
          TPOT is its per-request mean; ITL's tail (p99) shows the stalls that a mean hides, e.g. a
          decode step that waited behind another request's long prefill.
    E2E   end-to-end latency: from sending to the last byte of the response.

Why Poisson arrivals: real users do not arrive on a metronome. Independent users make arrivals a Poisson
process, whose gaps are exponential with mean 1/rate: sometimes three requests land together, sometimes
none for a while, and those bursts are what queue up and show in TTFT. The gaps come from a seeded
`random.Random(seed)`, so two runs (or two servers) see the same schedule.

`--request-rate inf` sends every request at once at t = 0: a burst that measures peak throughput and
how the server schedules a full queue, not latency under a steady load. `--max-concurrency N` caps how
many requests are in flight at a time (the others wait on our side, before their clock starts).

Throughputs divide by the wall time from the first send to the last response. Prompts are words drawn
from a built-in list (`--prompt-kind text`, about one token per word for a GPT-2 tokenizer) or lists
of random token ids (`--prompt-kind ids`; not every server accepts those).

Another script can reuse the pieces: `make_requests(...)` builds the workload, `run_benchmark(...)`
runs it and returns the report as a dict, `send_request(...)` sends and times one request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import percentile

# A fixed list of plain English words to build text prompts from: no data set to download, and with the
# same seed the same prompts on every machine.
_WORD_TEXT = """
    the of and to in is was that for it with as his on be at by had not are but from or have an they which one
    you were her all she there would their we him been has when who will more no if out so said what up its
    about into than them can only other new some could time these two may then do first any my now such like
    our over man me even most made after also did many before must through back years where much your way
    well down should because each just those people how too little state good very make world still own see
    men work long get here between both life being under never day same another know while last might us
    great old year off come since against go came right used take three house king queen night love heart
    light sword crown field river city ship storm fire stone water winter summer morning evening letter word
    friend enemy brother sister father mother child garden castle road forest mountain window door table
    bread wine gold silver honour truth grace fortune reason music voice hand eye face head blood death peace
    war battle dream hope fear joy sorrow sweet gentle noble proud fair bright dark cold warm quick slow
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass
class RequestResult:
    """What one request did. Times are `time.perf_counter()` seconds; durations are seconds."""

    ok: bool = False
    prompt_len: int = 0  # words (text prompts) or ids (id prompts) we sent, not server tokens
    max_tokens: int = 0
    send_time: float = 0.0
    ttft: float | None = None  # first chunk with text - send_time
    itl: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    latency: float = 0.0  # end - send_time
    output_tokens: int = 0  # usage.completion_tokens if the server sent it, else the number of text chunks
    error: str = ""
    status: int | None = None  # the HTTP status (None: no answer came: refused connection, or cut before it)
    retry_after: str | None = None  # the answer's Retry-After header (a 503 that says when to come back)
    created: float = 0.0  # when the load generator made the request; send_time - created: its wait in the client
    headers: float | None = None  # the response's headers - send_time (a 200's stream starts when it is admitted)


def make_prompt(rng: random.Random, length: int, prompt_kind: str) -> str | list[int]:
    """One prompt of `length` words (text) or token ids in [0, 255) (ids)."""
    if prompt_kind == "text":
        return " ".join(rng.choice(WORDS) for _ in range(length))
    if prompt_kind == "ids":
        return [rng.randrange(255) for _ in range(length)]
    raise ValueError(f"unknown prompt kind {prompt_kind!r} (text or ids)")


def make_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    prompt_kind: str = "text",
) -> tuple[list[str | list[int]], list[int]]:
    """The workload: `num_requests` prompts and their `max_tokens`, lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    prompts: list[str | list[int]] = []
    output_lens: list[int] = []
    for _ in range(num_requests):
        prompts.append(make_prompt(rng, rng.randint(*input_len), prompt_kind))
        output_lens.append(rng.randint(*output_len))
    return prompts, output_lens


def make_client(max_connections: int | None = None) -> httpx.AsyncClient:
    """One client (one connection pool) for all requests. httpx caps a pool at 100 connections by default:
    with more requests in flight the rest would wait for a connection and that wait would count as TTFT."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # The per-request deadline is enforced around the whole request in send_request; this one is per read.
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict, chunk_times: list[float],
                      res: RequestResult) -> int | None:  # fmt: skip
    """Send one streaming request, note its status, append the arrival time of every text chunk; return usage's
    token count."""
    usage_tokens: int | None = None
    async with client.stream("POST", url, json=body) as resp:
        res.headers = time.perf_counter() - res.send_time
        res.status, res.retry_after = resp.status_code, resp.headers.get("retry-after")
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:  # some servers report a failure mid-stream, after the 200 status
                raise RuntimeError(f"error in stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    chunk_times.append(now)
                    break
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                usage_tokens = int(usage["completion_tokens"])
    return usage_tokens


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    timeout: float = 600.0,
    ignore_eos: bool = True,
    created: float | None = None,
) -> RequestResult:
    """Send one streaming completion and time it. Never raises: a failure is a result with ok=False."""
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/SGLang extension; strict servers reject unknown fields
    url = base_url.rstrip("/") + "/completions"
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else len(prompt.split()))
    res.max_tokens = max_tokens
    chunk_times: list[float] = []
    res.send_time = time.perf_counter()
    res.created = res.send_time if created is None else created
    try:
        usage_tokens = await asyncio.wait_for(_stream_one(client, url, body, chunk_times, res), timeout)
        res.ok = True
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:g} s"
    except Exception as e:  # connection refused, bad JSON, HTTP errors: all count as failures
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    res.latency = end - res.send_time
    if chunk_times:
        res.ttft = chunk_times[0] - res.send_time
        res.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    if res.ok:
        res.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    return res


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Aggregate per-request results into the report (times in ms)."""
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    ttft = sorted(r.ttft * 1e3 for r in good if r.ttft is not None)
    tpot = sorted(
        (r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in good if r.ttft is not None and r.output_tokens > 1
    )
    itl = sorted(g * 1e3 for r in good for g in r.itl)
    e2e = sorted(r.latency * 1e3 for r in good)
    report: dict = {
        "num_requests": len(results),
        "successes": len(good),
        "failures": len(results) - len(good),
        "duration_s": duration,
        "request_throughput": len(good) / duration if duration > 0 else math.nan,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration if duration > 0 else math.nan,
    }
    for name, values, qs in (("ttft", ttft, (50, 90, 99)), ("tpot", tpot, (50, 90, 99)), ("itl", itl, (50, 90, 99))):
        report[f"mean_{name}_ms"] = sum(values) / len(values) if values else math.nan
        for q in qs:
            report[f"p{q}_{name}_ms"] = percentile(values, q)
    report["p50_e2e_ms"] = percentile(e2e, 50)
    report["p99_e2e_ms"] = percentile(e2e, 99)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    report["errors"] = errors
    return report


async def run_benchmark(
    base_url: str,
    model: str,
    prompts: list[str | list[int]],
    output_lens: list[int],
    request_rate: float,
    seed: int,
    max_concurrency: int | None = None,
    timeout: float = 600.0,
    ignore_eos: bool = True,
) -> dict:
    """Send the requests with Poisson arrivals at `request_rate` (inf: all at t = 0) and return the report.

    The arrival schedule is drawn up front from random.Random(seed); each request is a task started at its
    arrival time, so a slow server does not slow the arrivals down (an open-loop load, like real users).
    """
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    for _ in prompts:
        arrivals.append(t)
        if not math.isinf(request_rate):
            t += rng.expovariate(request_rate)  # exponential gap, mean 1 / rate
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with make_client(max_concurrency) as client:

        async def one(prompt: str | list[int], max_tokens: int) -> RequestResult:
            if sem is None:
                return await send_request(client, base_url, model, prompt, max_tokens, timeout, ignore_eos)
            async with sem:
                return await send_request(client, base_url, model, prompt, max_tokens, timeout, ignore_eos)

        start = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        for arrival, prompt, max_tokens in zip(arrivals, prompts, output_lens, strict=True):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    report = summarize(results, duration)
    report.update(base_url=base_url, model=model, request_rate=request_rate, max_concurrency=max_concurrency)
    report["requests"] = [asdict(r) | {"send_time": r.send_time - start} for r in results]
    return report


def get_default_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model id that `GET {base_url}/models` lists."""
    url = base_url.rstrip("/") + "/models"
    try:
        resp = httpx.get(url, timeout=timeout)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"could not list models at {url} ({first_line}): pass --model") from e
    if not data:
        raise SystemExit(f"{url} lists no model: pass --model")
    return data[0]["id"]


REPORT_ROWS: tuple[tuple[str, str, str], ...] = (
    ("label", "label", "s"),
    ("base url", "base_url", "s"),
    ("model", "model", "s"),
    ("requests", "num_requests", "d"),
    ("successes", "successes", "d"),
    ("failures", "failures", "d"),
    ("request rate (req/s)", "request_rate", "g"),
    ("duration (s)", "duration_s", ".2f"),
    ("request throughput (req/s)", "request_throughput", ".2f"),
    ("output tokens", "output_tokens", "d"),
    ("output throughput (tok/s)", "output_throughput", ".1f"),
    ("TTFT p50 / p90 / p99 (ms)", "ttft", ""),
    ("TPOT p50 / p90 / p99 (ms)", "tpot", ""),
    ("ITL  p50 / p90 / p99 (ms)", "itl", ""),
    ("E2E  p50 / p99 (ms)", "e2e", ""),
)


def error_hint(errors: dict[str, int]) -> str:
    """A likely fix for a known failure, or ''."""
    if any("ignore_eos" in e for e in errors):
        return "the server rejects the ignore_eos field (e.g. transformers serve): rerun with --no-ignore-eos"
    return ""


def format_report(report: dict) -> str:
    """The report as an aligned two-column table."""
    lines = []
    width = max(len(name) for name, _, _ in REPORT_ROWS)
    for name, key, fmt in REPORT_ROWS:
        if key in ("ttft", "tpot", "itl"):
            value = " / ".join(f"{report[f'p{q}_{key}_ms']:.1f}" for q in (50, 90, 99))
        elif key == "e2e":
            value = f"{report['p50_e2e_ms']:.1f} / {report['p99_e2e_ms']:.1f}"
        else:
            value = format(report.get(key, ""), fmt)
        lines.append(f"{name:<{width}}  {value}")
    for error, count in report.get("errors", {}).items():
        lines.append(f"{'error x' + str(count):<{width}}  {error[:200]}")
    if hint := error_hint(report.get("errors", {})):
        lines.append(f"{'hint':<{width}}  {hint}")
    rule = "=" * (width + 30)
    return "\n".join([rule, *lines, rule])


def json_safe(report: dict) -> dict:
    """inf and nan are not JSON: a rate of inf becomes the string "inf", a statistic with no data null."""

    def clean(v: object) -> object:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v

    return {k: clean(v) for k, v in report.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="model name sent in requests (default: first of GET /models)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf: all at once")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-kind", choices=("text", "ids"), default="text")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="leave out ignore_eos (for "
                    "servers that reject unknown fields; outputs may then end early)")  # fmt: skip
    ap.add_argument("--label", default="", help="a name for this run, printed in the report")
    ap.add_argument("--json", type=Path, default=None, help="also write the report (with per-request data) here")
    args = ap.parse_args()
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0 (or inf)")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX")

    model = args.model or get_default_model(args.base_url)
    prompts, output_lens = make_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed,
                                         args.prompt_kind)  # fmt: skip
    report = asyncio.run(run_benchmark(args.base_url, model, prompts, output_lens, args.request_rate, args.seed,
                                       max_concurrency=args.max_concurrency, timeout=args.timeout,
                                       ignore_eos=args.ignore_eos))  # fmt: skip
    report.update(label=args.label, input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                  prompt_kind=args.prompt_kind, ignore_eos=args.ignore_eos)  # fmt: skip
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(report), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
