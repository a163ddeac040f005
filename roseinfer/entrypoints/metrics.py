"""Prometheus metrics for the server (`GET /metrics`), under vLLM's names, labels and buckets.

A dashboard or alert written for vLLM reads this server unchanged. Three kinds, as in vLLM:

    gauges      the engine after the last step: vllm:num_requests_running / _waiting (/ _swapped, vLLM V0's),
                vllm:kv_cache_usage_perc (0-1)
    counters    totals since start: vllm:prompt_tokens_total, vllm:generation_tokens_total,
                vllm:num_preemptions_total, vllm:prefix_cache_queries_total / _hits_total (tokens),
                vllm:request_success_total{finished_reason="stop"|"length"|"abort"} (a client that
                disconnects is an abort); with speculative decoding vllm:spec_decode_num_drafts_total,
                _num_draft_tokens_total, _num_accepted_tokens_total, _num_accepted_tokens_per_pos_total{position}
    histograms  per request (stats.py has the timeline): vllm:time_to_first_token_seconds,
                vllm:inter_token_latency_seconds (and its older name vllm:time_per_output_token_seconds, the
                same observations, as vLLM still exports both), vllm:request_time_per_output_token_seconds,
                vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds, _prefill_time_seconds,
                _decode_time_seconds, _inference_time_seconds, vllm:request_prompt_tokens,
                vllm:request_generation_tokens

Every series has the labels model_name (the served name) and engine ("0": one engine core, as vLLM labels
its first). `rate(vllm:generation_tokens_total[1m])` is then the output throughput and
`histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))` the p99 TTFT. Each
server has its own registry, so that several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from roseinfer.entrypoints.async_engine import EngineSnapshot
from roseinfer.entrypoints.stats import IterationStats

disable_created_metrics()  # no `<name>_created` timestamp series next to every counter and histogram
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token counts: vLLM's buckets for its request-length histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 2048, spec_decode: bool = False):
        """`spec_decode`: the engine speculates (the spec_decode counters exist only then, as in vLLM)."""
        self.registry = r = CollectorRegistry()
        self.labels = (model_name, "0")
        names = ["model_name", "engine"]

        def make(kind, name, doc, **kw):
            return kind(f"vllm:{name}", doc, labelnames=names, registry=r, **kw).labels(*self.labels)

        self.running = make(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = make(Gauge, "num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = make(Counter, "num_preemptions", "Cumulative number of preemptions from the engine.")
        self.cache_queries = make(Counter, "prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.cache_hits = make(Counter, "prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=[*names, "finished_reason"], registry=r)  # fmt: skip
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token in seconds.",
                         buckets=TTFT_BUCKETS)  # fmt: skip
        self.itl = make(Histogram, "inter_token_latency_seconds", "Inter-token latency in seconds.",
                        buckets=TOKEN_GAP_BUCKETS)  # fmt: skip
        self.tpot_old = make(Histogram, "time_per_output_token_seconds",
                             "Inter-token latency in seconds (the older name of inter_token_latency_seconds).",
                             buckets=TOKEN_GAP_BUCKETS)  # fmt: skip
        self.request_tpot = make(
            Histogram,
            "request_time_per_output_token_seconds",
            "Mean time per output token of a request, in seconds.",
            buckets=TOKEN_GAP_BUCKETS,
        )
        phase = {"buckets": REQUEST_BUCKETS}
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.", **phase)
        self.queue = make(Histogram, "request_queue_time_seconds", "Time spent waiting to be scheduled.", **phase)
        self.prefill = make(Histogram, "request_prefill_time_seconds", "From scheduled to first token.", **phase)
        self.decode = make(Histogram, "request_decode_time_seconds", "From first token to last token.", **phase)
        self.inference = make(Histogram, "request_inference_time_seconds", "From scheduled to last token.", **phase)
        lengths = {"buckets": one_two_five_buckets(max_model_len)}
        self.request_prompt = make(Histogram, "request_prompt_tokens", "Prompt tokens of a request.", **lengths)
        self.request_generation = make(Histogram, "request_generation_tokens", "Generated tokens of a request.",
                                       **lengths)  # fmt: skip
        if spec_decode:
            self.spec = {key: make(Counter, f"spec_decode_{key}", f"Speculative decoding: {key.replace('_', ' ')}.")
                         for key in SPEC_COUNTERS}  # fmt: skip
            self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per "
                                        "position.", labelnames=[*names, "position"], registry=r)  # fmt: skip
        self._last = dict.fromkeys(("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"), 0)
        self._last_per_pos: list[int] = []

    def record(self, snap: EngineSnapshot, it: IterationStats) -> None:
        """After every turn of the step loop: the gauges, the counters' increments, the turn's observations."""
        s = snap.stats
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.swapped.set(snap.num_swapped)
        self.kv_usage.set(s["kv_blocks_used"] / s["kv_blocks_total"])
        for key, counter in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.cache_queries),
                             ("prefix_cache_hits", self.cache_hits)):  # fmt: skip
            counter.inc(s[key] - self._last[key])
            self._last[key] = s[key]
        if "spec_decode_num_drafts" in s and hasattr(self, "spec"):
            self._record_spec_decode(s)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens_iter:
            self.ttft.observe(t)
        for t in it.inter_token_latencies_iter:
            self.itl.observe(t)
            self.tpot_old.observe(t)
        for f in it.finished_requests:
            self.success[f.finish_reason if f.finish_reason in self.success else "abort"].inc()
            self.e2e.observe(f.e2e_latency)
            self.request_prompt.observe(f.num_prompt_tokens)
            self.request_generation.observe(f.num_generation_tokens)
            for hist, value in ((self.queue, f.queued_time), (self.prefill, f.prefill_time),
                                (self.decode, f.decode_time), (self.inference, f.inference_time),
                                (self.request_tpot, f.mean_time_per_output_token)):  # fmt: skip
                if value is not None:
                    hist.observe(value)

    def _record_spec_decode(self, s: dict) -> None:
        for key in SPEC_COUNTERS:
            self.spec[key].inc(s[f"spec_decode_{key}"] - self._last.get(key, 0))
            self._last[key] = s[f"spec_decode_{key}"]
        per_pos, last = s["spec_decode_num_accepted_tokens_per_pos"], self._last_per_pos
        for i, n in enumerate(per_pos):
            self.spec_per_pos.labels(*self.labels, str(i)).inc(n - (last[i] if i < len(last) else 0))
        self._last_per_pos = list(per_pos)

    def render(self) -> bytes:
        return generate_latest(self.registry)
