"""A health checker and a metrics scraper in a process of their own: GET /health and GET /metrics every 50 ms,
each on its own connection, and the latency of every answer written down.

    python -m benchmarks.serving.poller http://127.0.0.1:8000 --every 0.05 > samples.json   # until stdin closes

This is what a load balancer's health check and a Prometheus scraper see of a server. Both must stay fast
while the server is flooded: a /health that waits behind the engine gets the replica taken out of rotation
exactly when it is busiest, and a /metrics that stalls hides the overload from whoever watches it.

Why a process of its own: the load generator runs hundreds of streams on one event loop, and a poller on that
loop (or in a thread beside it, sharing its GIL) would time the load generator's queue, not the server. Two
threads here, one per path, each with its own `httpx.Client` (its own keep-alive connection): a slow /metrics
does not delay /health. A tick comes every `--every` seconds; an answer that takes longer makes the next request
start at once, without a burst of catch-up requests.

At the end (stdin closed, or SIGTERM) one JSON object goes to stdout:

    {"every_s": 0.05,
     "health":  [[t, ms, status], ...],
     "metrics": [[t, ms, status, running, waiting, kv_cache_usage_perc], ...],
     "sockets": [[t, accept_queue, established], ...]}

t is `time.monotonic()` when the request was sent (one clock for every process of a Linux machine, so the caller
can cut the samples into its own phases); ms runs until the whole body was read; status 0 means no answer
(a refused connection, a timeout). The three gauges are vLLM's, read from the answer (None if absent). "sockets"
is what the kernel holds for the server's port (/proc/net/tcp, tcp6), read as often: connections that finished
the TCP handshake but that the server has not accepted yet (the listening socket's queue), and every connection
established to the port, accepted or not. A request waiting there has not reached the server's code at all.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_cache_usage_perc": "vllm:kv_cache_usage_perc"}  # fmt: skip
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", re.M)


def gauges(text: str) -> dict[str, float | None]:
    """The three gauges of a /metrics answer (Prometheus text), by their short names; None for an absent one."""
    found = {name: float(value) for name, value in _SAMPLE.findall(text) if name in GAUGES.values()}
    return {short: found.get(name) for short, name in GAUGES.items()}


def poll(base_url: str, path: str, every: float, stop: threading.Event, out: list, timeout: float = 10.0) -> None:
    """GET base_url + path every `every` s until `stop`, appending [t, ms, status] (+ the gauges for /metrics)."""
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        next_at = time.monotonic()
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = client.get(path)
                status, text = r.status_code, r.text
            except httpx.HTTPError:
                status, text = 0, ""
            sample = [round(t, 4), round((time.monotonic() - t) * 1e3, 3), status]
            if path == "/metrics":
                sample += list(gauges(text).values())
            out.append(sample)
            next_at = max(next_at + every, time.monotonic())  # late: the next one at once, no catch-up
            stop.wait(next_at - time.monotonic())


def socket_counts(port: int) -> tuple[int, int]:
    """(accept queue, established connections) of a local TCP port, from /proc/net/tcp and tcp6: a listening
    socket's rx_queue is the number of connections waiting for accept()."""
    queue = established = 0
    local = f":{port:04X}"  # the local address's port, as the table writes it
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:  # tens of thousands under overload: split only the fields read
            fields = line.split(None, 5)
            if not fields[1].endswith(local):
                continue
            if fields[3] == "0A":  # LISTEN
                queue += int(fields[4].split(":")[1], 16)
            elif fields[3] == "01":  # ESTABLISHED
                established += 1
    return queue, established


def watch_sockets(port: int, every: float, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        out.append([round(time.monotonic(), 4), *socket_counts(port)])
        stop.wait(every)


def run(base_url: str, every: float, stop: threading.Event) -> dict:
    """Poll /health and /metrics on two threads, and the server port's sockets on a third, until `stop` is set;
    the samples."""
    samples: dict = {"every_s": every, "health": [], "metrics": [], "sockets": []}
    threads = [threading.Thread(target=poll, args=(base_url, f"/{p}", every, stop, samples[p]), daemon=True)
               for p in ("health", "metrics")]  # fmt: skip
    port = httpx.URL(base_url).port
    threads.append(threading.Thread(target=watch_sockets, args=(port, every, stop, samples["sockets"]), daemon=True))
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=30)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base_url", help="the server, without a path: http://127.0.0.1:8000")
    ap.add_argument("--every", type=float, default=0.05, help="seconds between two requests to the same path")
    args = ap.parse_args(argv)
    if not args.every > 0:
        ap.error("--every must be > 0")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()  # stdin closed: stop
    json.dump(run(args.base_url.rstrip("/"), args.every, stop), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
