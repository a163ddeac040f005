"""The OpenAI-compatible server, operated: vLLM's metrics, the queue-time hook, a draining shutdown driven by
signals in a real `roseinfer serve` subprocess, and a fuzz of the HTTP API from its own OpenAPI schema."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import REPO
from test_13_server import assert_engine_empty
from test_19_server import ENGINE, LLAMA, assert_openai_error, serving

from benchmarks.common import free_port, start_server
from roseinfer import LLM, LLMEngine, RequestOutputKind, SamplingParams
from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.stats import IterationStats


@pytest.fixture(scope="module")
def llama_llm():
    return LLM(LLAMA, **ENGINE)


# ---- metrics ------------------------------------------------------------------------------------------------------
def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of the Prometheus text (0 if absent)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return 0.0


def test_metrics_have_vllms_names_and_count_tokens_phases_and_aborts():
    engine = AsyncLLMEngine(LLMEngine(LLAMA, max_num_seqs=1, **ENGINE))
    with serving(engine) as (url, _):
        before = httpx.get(url + "/metrics").text
        assert "roseinfer:" not in before and metric(before, "vllm:num_requests_running", model_name="roseinfer") == 0
        assert 'engine="0"' in before and "vllm:spec_decode" not in before  # no speculation: no such counters

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                two = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 6, "ignore_eos": True})
                       for p in ("Romeo.\n", "KING.")]  # fmt: skip
                answers = await asyncio.gather(*two)  # max_num_seqs=1: the second one queues
                body = {"prompt": "Romeo.\n", "max_tokens": 300, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # a client that leaves mid-stream: an abort
                return answers

        answers = asyncio.run(scenario())
        assert_engine_empty(engine)
        text = httpx.get(url + "/metrics").text
    prompt = sum(r.json()["usage"]["prompt_tokens"] for r in answers) + len(engine.engine.tokenizer.encode("Romeo.\n"))
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 2
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(text, "vllm:generation_tokens_total") >= 12 + 1  # + what the aborted one streamed
    assert metric(text, "vllm:prompt_tokens_total") == prompt
    assert metric(text, "vllm:request_generation_tokens_sum") >= 12
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens"):  # fmt: skip
        assert metric(text, f"vllm:{name}_count") == 3, name
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert metric(text, f"vllm:{name}_count") >= 10, name  # 5 gaps for each of the two, more for the third
    assert metric(text, "vllm:request_time_per_output_token_seconds_count") >= 2  # (the third: if it had 2 tokens)
    for name in ("num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):  # fmt: skip
        assert f"vllm:{name}{{" in text, name


def test_queue_time_runs_from_arrival_to_the_first_scheduled_step():
    """max_num_seqs=1, two requests that arrive together: the second is scheduled only after the first finished,
    so its queue time is at least the first one's whole latency; the first barely queued."""

    async def scenario():
        engine = AsyncLLMEngine(LLMEngine(LLAMA, max_num_seqs=1, **ENGINE))
        finished = []
        engine.stat_logger = lambda snap, it: finished.extend(it.finished_requests)
        delta = RequestOutputKind.DELTA  # as the server asks: each output holds its step's tokens
        arrival, params = time.perf_counter(), SamplingParams(max_tokens=5, ignore_eos=True, output_kind=delta)

        async def run(rid):
            return [o async for o in engine.generate("Romeo.\n", params, rid, arrival_time=arrival)]

        await asyncio.gather(run("a"), run("b"))
        waiting = engine.generate("Romeo.\n", SamplingParams(max_tokens=400, ignore_eos=True, output_kind=delta), "c")
        await waiting.__anext__()
        await waiting.aclose()  # aborted after its first token
        await asyncio.sleep(0.1)
        await engine.shutdown()
        return finished

    first, second, aborted = asyncio.run(scenario())
    assert first.finish_reason == second.finish_reason == "length"
    assert second.queued_time >= first.e2e_latency > first.queued_time
    assert second.e2e_latency >= second.queued_time + second.inference_time - 1e-9
    assert aborted.finish_reason == "abort" and aborted.num_generation_tokens >= 1


def test_iteration_stats_count_delta_outputs_once():
    from roseinfer.entrypoints.stats import RequestStateStats
    from roseinfer.outputs import CompletionOutput, RequestOutput

    stats, it = RequestStateStats(arrival_time=10.0, output_kind=RequestOutputKind.DELTA), IterationStats()
    step = [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "a", [7])], None) for _ in range(2)]
    it.update_from_output(step[0], stats, 11.0)
    it.update_from_output(step[1], stats, 11.5)
    it.finish(stats, "length", 12.0)
    assert it.num_prompt_tokens == 3 and it.num_generation_tokens == 2 == stats.num_generation_tokens
    assert it.time_to_first_tokens_iter == [1.0] and it.inter_token_latencies_iter == [0.5]
    done = it.finished_requests[0]
    assert done.e2e_latency == 2.0 and done.decode_time == 0.5 and done.queued_time == 1.0  # scheduled: not noted


# ---- shutdown -----------------------------------------------------------------------------------------------------
@contextmanager
def serve_process(*flags: str, env: dict | None = None):
    """`python -m roseinfer serve` on a free port; killed at the end if it is still alive."""
    port = free_port()
    cmd = [sys.executable, "-m", "roseinfer", "serve", "--port", str(port), "--device", "cpu", "--num-blocks", "128",
           "--model", LLAMA, "--attention-backend", "sdpa", *flags]  # fmt: skip
    proc = start_server(cmd, port, env=env, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


async def read_stream(c: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> tuple[int, list]:
    """(status, the data lines of an SSE stream, or the JSON body of a refusal)."""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(await r.aread())]
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if started is not None:
                    started.set()
        return 200, lines


def completion_text(lines: list[str]) -> str:
    chunks = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_sigterm_drains_every_stream_to_its_end_and_refuses_new_work():
    key = {"Authorization": "Bearer k3y"}
    with serve_process("--shutdown-timeout", "120", env={"ROSEINFER_API_KEY": "k3y"}) as (proc, url):
        assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 401  # the key from the env

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=key) as c:
                body = {
                    "prompt": "Romeo.\n",
                    "max_tokens": 300,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(read_stream(c, body, e)) for e in started]
                for e in started:
                    await e.wait()
                proc.send_signal(signal.SIGTERM)
                refused = None
                while refused is None:  # a new request is refused (503, or no connection at all) meanwhile
                    try:
                        async with httpx.AsyncClient(base_url=url, timeout=30, headers=key) as fresh:
                            r = await fresh.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                        refused = r if r.status_code == 503 else None
                    except httpx.TransportError as e:
                        refused = e
                    await asyncio.sleep(0.02)
                in_flight = sum(not s.done() for s in streams)
                return await asyncio.gather(*streams), refused, in_flight

        results, refused, in_flight = asyncio.run(scenario())
        assert in_flight > 0, "the streams ended before a new request was refused"
        if isinstance(refused, httpx.Response):
            assert_openai_error(refused, 503, "shutting down")
        for status, lines in results:
            assert status == 200 and lines[-1] == "data: [DONE]"
            assert not any('"error"' in x for x in lines) and len(completion_text(lines)) > 0
            assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 300  # every token of it
        assert proc.wait(timeout=60) == 0


def test_a_second_ctrl_c_ends_open_streams_with_an_error_event():
    with serve_process("--shutdown-timeout", "120") as (proc, url):

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                body = {"prompt": "Romeo.\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(read_stream(c, body, e)) for e in started]
                for e in started:
                    await e.wait()
                proc.send_signal(signal.SIGINT)
                for e in started:  # they go on streaming while the server drains
                    e.clear()
                for e in started:
                    await e.wait()
                proc.send_signal(signal.SIGINT)
                return await asyncio.gather(*streams)

        for status, lines in asyncio.run(scenario()):
            assert status == 200 and lines[-1] == "data: [DONE]"
            err = json.loads(lines[-2][6:])["error"]
            assert err["code"] == 503 and "second interrupt" in err["message"] and err["type"]
            assert len(lines) < 480
        assert proc.wait(timeout=60) == 0


def test_the_shutdown_timeout_ends_streams_and_answers_waiting_requests_503():
    with serve_process("--shutdown-timeout", "0.5", "--max-num-seqs", "1") as (proc, url):

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                body = {"prompt": "Romeo.\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
                started = asyncio.Event()
                running = asyncio.create_task(read_stream(c, body, started))
                await started.wait()
                waiting = [asyncio.create_task(read_stream(c, body)) for _ in range(2)]
                await asyncio.sleep(0.2)  # let them reach the server's queue
                proc.send_signal(signal.SIGTERM)
                return await running, await asyncio.gather(*waiting)

        (status, lines), waiting = asyncio.run(scenario())
        assert status == 200 and lines[-1] == "data: [DONE]" and "--shutdown-timeout" in lines[-2]
        for status, body in waiting:  # never cut: a complete stream, or a 503 in OpenAI's shape
            assert (status == 503 and body[0]["error"]["code"] == 503) or (status == 200 and body[-1] == "data: [DONE]")
        assert proc.wait(timeout=60) == 0


# ---- fuzz ---------------------------------------------------------------------------------------------------------
def test_fuzz_the_http_api_from_its_openapi_schema(llama_llm):
    """schemathesis generates requests from the server's own OpenAPI schema, valid ones and invalid ones, for every
    route: none may get a 5xx, every 4xx is OpenAI-shaped, and afterwards a plain request still answers right."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    engine = AsyncLLMEngine(LLMEngine(LLAMA, max_num_seqs=4, max_model_len=48, **ENGINE))
    with serving(engine, max_waiting=8) as (url, app):
        schema = schemathesis.openapi.from_dict(app.openapi())
        seen = {}
        for result in schema.get_all_operations():
            op = result.ok()
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
            for mode in modes:

                @settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))  # fmt: skip
                @given(case=op.as_strategy(generation_mode=mode))
                def check(case):
                    r = case.call(base_url=url, timeout=120)
                    assert r.status_code < 500, (case.method, case.path, case.body, r.status_code, r.text[:500])
                    if r.status_code >= 400:
                        err = r.json()["error"]
                        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1

                check()
        assert seen.get(200, 0) > 10 and seen.get(400, 0) > 10, seen
        want = llama_llm.generate(["Romeo.\n"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].text
        r = httpx.post(url + "/v1/completions", json={"prompt": "Romeo.\n", "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want
        assert_engine_empty(engine)


def test_cli_reads_the_api_key_from_the_environment(monkeypatch):

    from roseinfer.entrypoints.cli import read_chat_template, serve_parser

    monkeypatch.setenv("ROSEINFER_API_KEY", "from-env")
    args = serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args([])
    assert args.api_key == "from-env" and args.shutdown_timeout == 30 and args.max_request_body_bytes == 10 * 2**20
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    template = Path(REPO / "tests" / "conftest.py")
    assert read_chat_template(str(template)) == template.read_text()
    with pytest.raises(SystemExit, match="neither a file"):
        read_chat_template("no-such-file.jinja")
