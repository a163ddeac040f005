"""Stage 13: the OpenAI-compatible server, over real HTTP on 127.0.0.1, with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from conftest import PROMPTS, core, greedy_ids, run_python

from benchmarks.common import free_port, start_server
from roseinfer import LLMEngine, RequestOutputKind, SamplingParams
from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.openai.api_server import build_app


@contextmanager
def serving(engine: AsyncLLMEngine, **app_kwargs):
    """build_app(engine, ...) in uvicorn on a free loopback port, in a thread of this process (so that tests can
    look at the engine's pool); stopped and joined when the block ends. Yields (base url, app)."""
    app = build_app(engine, "roseinfer", **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def running_server(max_waiting: int = 1024, **engine_kwargs):
    """The real app over a fresh engine (`serving`); yields (base url, the AsyncLLMEngine)."""
    engine = AsyncLLMEngine(LLMEngine(device="cpu", dtype="float32", **engine_kwargs))
    with serving(engine, max_waiting=max_waiting) as (url, _):
        yield url, engine


def is_empty(engine: LLMEngine) -> bool:
    """No unfinished request (nor any of its sequences) in the engine, and no KV block held."""
    kv = core(engine).kv_cache_manager
    return not engine.output_processor.requests and not core(engine).scheduler.requests and not kv.block_tables


def assert_engine_empty(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    """Nothing left: no request in the engine or its queues, no KV block held (within `timeout`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if is_empty(engine.engine) and engine.num_unfinished == 0:
            break
        time.sleep(0.05)
    assert is_empty(engine.engine) and engine.num_unfinished == 0
    assert core(engine.engine).kv_cache_manager.stats().used_blocks == 0


@pytest.fixture(scope="module")
def server():
    with running_server(max_num_seqs=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(llm):
    """What LLM.generate gives for the prompts, greedy, 16 tokens."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


# ---- the happy path --------------------------------------------------------------------------------------------
def test_health_models_and_greedy_text_equals_llm_generate(server, client, reference):
    assert httpx.get(server[0] + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["roseinfer"]
    for prompt in PROMPTS:
        r = client.completions.create(model="roseinfer", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == reference[prompt] and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0
    assert_engine_empty(server[1])


def test_streaming_text_equals_llm_generate_and_ends_with_usage(client, reference):
    for prompt in PROMPTS[:4]:
        chunks = list(client.completions.create(model="roseinfer", prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))  # fmt: skip
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == reference[prompt]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_token_id_prompts_a_batch_of_prompts_and_n(server, client, reference, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model="roseinfer", prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == reference[PROMPTS[0]]
    r = client.completions.create(model="roseinfer", prompt=PROMPTS[:3], max_tokens=16, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [reference[p] for p in PROMPTS[:3] for _ in range(2)]
    seeded = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=12)
    want = [c.text for c in llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs]
    r = client.completions.create(model="roseinfer", prompt=PROMPTS[1], max_tokens=12, temperature=0.9, seed=11, n=3)
    assert [c.text for c in r.choices] == want and len(set(want)) > 1
    streamed = client.completions.create(model="roseinfer", prompt=PROMPTS[1], max_tokens=12, temperature=0.9,
                                         seed=11, n=3, stream=True)  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    assert_engine_empty(server[1])


def test_the_engine_hands_the_server_only_each_steps_new_tokens(server, client, reference, llm, monkeypatch):
    """The server asks for DELTA outputs: every output the engine yields holds that step's token, not all so far."""
    engine, seen = server[1], []
    generate = engine.generate

    async def recording(prompt, params, request_id=None, **kwargs):
        async for out in generate(prompt, params, request_id=request_id, **kwargs):
            seen.append((params.output_kind, list(out.token_ids), out.text))
            yield out

    monkeypatch.setattr(engine, "generate", recording)
    r = client.completions.create(model="roseinfer", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == reference[PROMPTS[0]]
    assert [kind for kind, _, _ in seen] == [RequestOutputKind.DELTA] * 16
    assert [len(ids) for _, ids, _ in seen] == [1] * 16  # one new token a step
    assert [t for _, ids, _ in seen for t in ids] == greedy_ids(llm, PROMPTS[0], 16)
    assert "".join(text for _, _, text in seen) == reference[PROMPTS[0]]


def test_stop_strings_and_metrics(server, client):
    r = client.completions.create(model="roseinfer", prompt="Romeo.\n", max_tokens=40, temperature=0, stop=["."])
    assert "." not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    text = httpx.get(server[0] + "/metrics").text
    names = ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
             "num_preemptions_total", "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
             "inter_token_latency_seconds_count", "e2e_request_latency_seconds_sum"]  # fmt: skip
    for name in names:
        assert f"vllm:{name}" in text, name
    assert "roseinfer:" not in text  # vLLM's names only: a dashboard made for vLLM reads this server
    count = [line for line in text.splitlines() if line.startswith("vllm:e2e_request_latency_seconds_count")]
    assert float(count[0].split()[-1]) >= 1
    stop = [line for line in text.splitlines() if line.startswith("vllm:request_success_total") and '"stop"' in line]
    assert float(stop[0].split()[-1]) >= 1


# ---- bad input ------------------------------------------------------------------------------------------------
BAD = [
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_k": 0}, 400, "top_k"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "n": 0}, 400, "n must be"),
    ({"prompt": "a", "n": 65}, 400, "max_num_seqs"),
    ({"prompt": "a", "seed": "x"}, 400, "seed"),
    ({"prompt": "a", "stop": 5}, 400, "stop"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ({"max_tokens": 4}, 400, "prompt is required"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "vocabulary"),
    ({"prompt": [5] * 600}, 400, "context"),
    ({"prompt": [5] * 500, "max_tokens": 100}, 400, "maximum context length"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
]


@pytest.mark.parametrize(("body", "status", "match"), BAD, ids=[f"{b}"[:50] for b, _, _ in BAD])
def test_bad_input_gets_its_status_and_an_openai_error(server, body, status, match):
    r = httpx.post(server[0] + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["code"] == status and err["type"]
    assert_engine_empty(server[1])


def test_bad_json_and_the_openai_client_raises(server, client):
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(server[0] + "/v1/completions", json=[1, 2]).status_code == 400
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="roseinfer", prompt="a", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")


def test_a_full_waiting_queue_answers_503():
    with running_server(max_waiting=1, max_num_seqs=1) as (url, engine):

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                long = {"prompt": "Romeo.\n", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
                async with c.stream("POST", "/v1/completions", json=long | {"stream": True}) as a:
                    lines = a.aiter_lines()
                    assert (await lines.__anext__()).startswith("data:")  # a runs (max_num_seqs=1)
                    waiting = asyncio.create_task(c.post("/v1/completions", json=long | {"max_tokens": 2}))
                    while engine.num_waiting < 1:
                        await asyncio.sleep(0.01)
                    r = await c.post("/v1/completions", json=long | {"max_tokens": 2})
                    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
                assert (await waiting).status_code == 200

        asyncio.run(scenario())
        assert_engine_empty(engine)


# ---- load and disconnects -------------------------------------------------------------------------------------
def test_200_concurrent_streams_complete_with_the_right_text(server, reference):
    async def one(c: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
        text = ""
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_of_them():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=server[0], timeout=300, limits=limits) as c:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]
            return prompts, await asyncio.gather(*(one(c, p) for p in prompts))

    prompts, texts = asyncio.run(all_of_them())
    assert texts == [reference[p] for p in prompts]
    assert_engine_empty(server[1])


def test_50_clients_that_disconnect_mid_stream_leave_nothing_behind(server):
    engine = server[1]

    async def leave_early(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 2:
                    break  # leaving the block closes the connection mid-stream

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server[0], timeout=120, limits=httpx.Limits(max_connections=60)) as c:
            await asyncio.gather(*(leave_early(c, i) for i in range(50)))

    asyncio.run(all_of_them())
    assert_engine_empty(engine, timeout=10)
    stats = engine.engine.get_stats()
    assert stats["kv_blocks_used"] == 0
    # not streaming: a client that gives up while it waits for the whole answer aborts it too
    long = {"prompt": "Romeo.\n", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server[0] + "/v1/completions", json=long, timeout=httpx.Timeout(60, read=0.5))
    assert_engine_empty(engine, timeout=0.5)  # 500 tokens would take seconds


def test_async_engine_closing_a_stream_aborts_the_request():
    async def scenario():
        engine = AsyncLLMEngine(LLMEngine(device="cpu", dtype="float32"))
        gen = engine.generate("Romeo.\n", SamplingParams(max_tokens=300, ignore_eos=True), request_id="r")
        out = await gen.__anext__()
        assert not out.finished and core(engine.engine).kv_cache_manager.stats().used_blocks > 0
        await gen.aclose()
        for _ in range(100):  # aborted before the next step
            if is_empty(engine.engine):
                break
            await asyncio.sleep(0.01)
        assert is_empty(engine.engine) and core(engine.engine).kv_cache_manager.stats().used_blocks == 0
        with pytest.raises(ValueError, match="max_num_seqs"):  # the engine's own check reaches the caller
            await engine.generate("a", SamplingParams(n=100)).__anext__()
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_request_being_handed_to_the_engine_still_counts_as_waiting():
    """While a step runs, the requests it took from the queue are in no snapshot yet: they still wait (else a
    server with max_waiting=1 could accept a second one in that window)."""

    async def scenario():
        engine = AsyncLLMEngine(LLMEngine(device="cpu", dtype="float32", max_num_seqs=1))
        inside, release = threading.Event(), threading.Event()
        step = engine.engine.step

        def slow_step():
            inside.set()
            release.wait(10)
            return step()

        engine.engine.step = slow_step
        gen = engine.generate("Romeo.\n", SamplingParams(max_tokens=2), request_id="r")
        first = asyncio.ensure_future(gen.__anext__())
        while not inside.is_set():
            await asyncio.sleep(0.01)
        assert engine.num_waiting == 1  # handed over, inside the step: still waiting
        release.set()
        await first
        assert engine.num_waiting == 0  # the snapshot now has it running
        await gen.aclose()
        await engine.shutdown()

    asyncio.run(scenario())


def test_roseinfer_serve_command_starts_and_answers():
    port = free_port()
    env_py = [sys.executable, "-m", "roseinfer", "serve", "--port", str(port), "--device", "cpu", "--num-blocks", "64"]
    proc = start_server(env_py, port, timeout=30, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "KING.", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_example_runs():
    r = run_python("examples/serve_example.py", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "HTTP 400" in r.stdout and "vllm:num_requests_running" in r.stdout and "server stopped" in r.stdout
