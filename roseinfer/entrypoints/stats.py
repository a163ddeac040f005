"""Per-request timings and per-step counts, as the async engine sees them (vLLM's v1/metrics/stats.py).

A request's life, and the timestamps that cut it into the phases Prometheus shows (metrics.py):

    arrival ──── queued ────► scheduled ── prefill ──► first token ─── decode ───► last token
       │                         │                         │      ITL  ITL  ITL      │
       └────────── time to first token (TTFT) ─────────────┘                        │
       └──────────────────────────────── end-to-end latency ────────────────────────┘
                                 └──────────────── inference time ──────────────────┘

- arrival: when the server took the request (before it was tokenized);
- scheduled: the start of the engine step that first gave it tokens to compute (the step thread notes it);
- first token / each later output: when the step loop handed the output to the request's stream. An output
  can carry several tokens (speculative decoding), so an inter-token latency (ITL) is per output, as in vLLM.

All times are `time.perf_counter()` seconds: one clock for the event loop and the step thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import RequestOutputKind


@dataclass(slots=True)
class RequestStateStats:
    """One request's timestamps and counts so far."""

    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass(slots=True)
class FinishedRequestStats:
    """A request that ended (finish_reason "stop", "length" or "abort"), its phases in seconds."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float | None  # None: never scheduled (aborted while waiting)
    prefill_time: float | None  # None: no token yet
    decode_time: float | None
    inference_time: float | None
    mean_time_per_output_token: float | None  # None: fewer than two tokens


@dataclass
class IterationStats:
    """What one turn of the step loop did, for the metrics: tokens, first tokens, gaps, finished requests."""

    num_prompt_tokens: int = 0  # of the requests whose first token came in this turn (their prefill ended)
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def update_from_output(self, out: RequestOutput, stats: RequestStateStats, now: float) -> None:
        """Count an output of a step: the first token's time, or the gap since the last output, and the new
        tokens. A DELTA output holds only the step's tokens; a cumulative one holds them all, and reading them
        costs their number, so those are counted once, when the request finishes."""
        delta = stats.output_kind == RequestOutputKind.DELTA
        new = sum(len(c.token_ids) for c in out.outputs) if delta or out.finished else 0
        if not delta:
            new -= stats.num_generation_tokens if out.finished else 0
        elif new == 0:
            return  # no token for it in this step (a finished completion of n, repeated)
        if stats.first_token_ts is None:
            stats.first_token_ts = now
            stats.num_prompt_tokens = len(out.prompt_token_ids)
            self.num_prompt_tokens += stats.num_prompt_tokens
            self.time_to_first_tokens_iter.append(now - stats.arrival_time)
        else:
            self.inter_token_latencies_iter.append(now - stats.last_token_ts)
        stats.last_token_ts = now
        stats.num_generation_tokens += new
        self.num_generation_tokens += new

    def finish(self, stats: RequestStateStats, reason: str, now: float) -> None:
        self.finished_requests.append(finished_stats(stats, reason, now))


def finished_stats(s: RequestStateStats, reason: str, now: float) -> FinishedRequestStats:
    first, last, sched = s.first_token_ts, s.last_token_ts, s.scheduled_ts
    if sched is None and first is not None:
        sched = first  # scheduled and done within one step whose start was not noted: no time in the queue
    tpot = (last - first) / (s.num_generation_tokens - 1) if first is not None and s.num_generation_tokens > 1 else None
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=now - s.arrival_time,
        num_prompt_tokens=s.num_prompt_tokens,
        num_generation_tokens=s.num_generation_tokens,
        queued_time=None if sched is None else max(0.0, sched - s.arrival_time),
        prefill_time=None if first is None else first - sched,
        decode_time=None if first is None else last - first,
        inference_time=None if first is None else last - sched,
        mean_time_per_output_token=tpot,
    )
