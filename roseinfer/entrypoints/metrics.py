"""Prometheus metrics for the server (`GET /metrics`), with vLLM's names under our prefix.

Three kinds, as in vLLM:

    gauges      the engine's state after the last step: requests running / waiting / swapped,
                KV blocks in use and the share of the pool they are
    counters    totals since start: preemptions, prefix-cache queries and hits (tokens), prompt and
                generated tokens, finished requests by finish reason; with speculative decoding
                drafts verified, draft tokens proposed and accepted, accepted per position
    histograms  per request, seen from the server: time to first token (arrival -> first text),
                time per output token after the first, end-to-end latency

A Prometheus server scrapes the text format; `rate(roseinfer:generation_tokens_total[1m])` is then the
output throughput and `histogram_quantile(0.99, ...)` a p99 latency. Each server has its own registry,
so that several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from roseinfer.entrypoints.async_engine import EngineSnapshot

disable_created_metrics()  # no `<name>_created` timestamp series next to every counter and histogram
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": r}
        self.running = Gauge("roseinfer:num_requests_running", "Requests in the running batch.", **label)
        self.waiting = Gauge("roseinfer:num_requests_waiting", "Requests waiting to be scheduled.", **label)
        self.swapped = Gauge("roseinfer:num_requests_swapped", "Requests swapped out to host memory.", **label)
        self.kv_blocks = Gauge("roseinfer:kv_blocks_used", "KV blocks held by requests.", **label)
        self.kv_usage = Gauge("roseinfer:kv_cache_usage_perc", "Share of the KV pool in use (0-1).", **label)
        self.preemptions = Counter("roseinfer:num_preemptions", "Preemptions since start.", **label)
        self.cache_queries = Counter("roseinfer:prefix_cache_queries", "Prompt tokens looked up.", **label)
        self.cache_hits = Counter("roseinfer:prefix_cache_hits", "Prompt tokens found cached.", **label)
        self.prompt_tokens = Counter("roseinfer:prompt_tokens", "Prompt tokens of finished requests.", **label)
        self.generation_tokens = Counter("roseinfer:generation_tokens", "Tokens generated.", **label)
        self.success = Counter("roseinfer:request_success", "Finished requests.",
                               labelnames=["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.ttft = Histogram("roseinfer:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, **label)  # fmt: skip
        self.tpot = Histogram("roseinfer:time_per_output_token_seconds", "Mean time per token after the first.",
                              buckets=TOKEN_BUCKETS, **label)  # fmt: skip
        self.e2e = Histogram("roseinfer:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, **label)  # fmt: skip
        self.spec_drafts = Counter("roseinfer:spec_decode_num_drafts", "Verifications of drafts.", **label)
        self.spec_draft_tokens = Counter("roseinfer:spec_decode_num_draft_tokens", "Draft tokens proposed.", **label)
        self.spec_accepted = Counter("roseinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted.", **label)
        self.spec_per_pos = Counter("roseinfer:spec_decode_num_accepted_tokens_per_pos", "Accepted at position.",
                                    labelnames=["model_name", "position"], registry=r)  # fmt: skip
        self.model_name = model_name
        self._last = dict.fromkeys(("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"), 0)
        self._last_per_pos: list[int] = []

    def on_step(self, snap: EngineSnapshot) -> None:
        """After every engine step: set the gauges, add the counters' increments since the last step."""
        m, s = self.model_name, snap.stats
        self.running.labels(m).set(snap.num_running)
        self.waiting.labels(m).set(snap.num_waiting)
        self.swapped.labels(m).set(snap.num_swapped)
        self.kv_blocks.labels(m).set(s["kv_blocks_used"])
        self.kv_usage.labels(m).set(s["kv_blocks_used"] / s["kv_blocks_total"])
        for key, counter in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.cache_queries),
                             ("prefix_cache_hits", self.cache_hits)):  # fmt: skip
            counter.labels(m).inc(s[key] - self._last[key])
            self._last[key] = s[key]
        if "spec_decode_num_drafts" not in s:
            return
        for key, counter in (("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted)):  # fmt: skip
            counter.labels(m).inc(s[key] - self._last.get(key, 0))
            self._last[key] = s[key]
        per_pos, last = s["spec_decode_num_accepted_tokens_per_pos"], self._last_per_pos
        for i, n in enumerate(per_pos):
            self.spec_per_pos.labels(m, str(i)).inc(n - (last[i] if i < len(last) else 0))
        self._last_per_pos = list(per_pos)

    def on_finish(self, reason: str, num_prompt: int, num_generated: int, arrival: float, first: float | None,
                  end: float) -> None:  # fmt: skip
        """A request ended: its latencies (times from time.perf_counter) and its token counts."""
        m = self.model_name
        self.success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.generation_tokens.labels(m).inc(num_generated)
        if first is not None:
            self.ttft.labels(m).observe(first - arrival)
            if num_generated > 1:
                self.tpot.labels(m).observe((end - first) / (num_generated - 1))
        self.e2e.labels(m).observe(end - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
