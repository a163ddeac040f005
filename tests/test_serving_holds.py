"""Serving that holds. The server runs on an allocator that gives memory back (tcmalloc or jemalloc, preloaded
by restarting itself once). And chaos on the server, bounded: for a fixed time, many clients at once send a
mix of good and bad requests above what the server takes (a small pool, a short waiting queue), walk away
mid-stream or before the first token, and ask for n > 1, penalties, stop strings and log-probabilities.
Afterwards nothing is left behind: every KV block is free, the metrics show no request running or waiting,
and a plain request is answered as before the storm. A request that outlives `--request-timeout` is aborted
(its blocks freed at once) and answered 504, in a stream as an error event. Loopback only; every loop is
bounded in count and time."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from conftest import DEFAULT_MODEL
from test_13_server import assert_engine_empty, serving
from test_19_server import assert_openai_error
from test_19_server_ops import metric, read_stream, serve_process

from benchmarks.engine import onednn_primitives
from roseinfer import EngineArgs, LLMEngine, SamplingParams
from roseinfer.entrypoints import allocator
from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.cli import serve_parser
from roseinfer.entrypoints.openai.serving_engine import ClientDisconnected, until_disconnect

DURATION_S = 12.0
CLIENTS = 16
MAX_REQUESTS = 600  # a bound on the whole storm, whatever the machine's speed


def _body(rng: random.Random, kind: str) -> dict:
    prompt = rng.choice(["Romeo.\n", "Juliet.\n", "Enter the Nurse.\n", "O Romeo, Romeo!"])
    return {
        "good": {"prompt": prompt, "max_tokens": rng.randint(1, 12)},
        "n": {"prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 0.9, "seed": rng.randint(0, 99)},
        "penalty": {
            "prompt": prompt,
            "max_tokens": 8,
            "presence_penalty": 1.0,
            "frequency_penalty": 0.5,
            "stop": ["\n\n"],
            "logprobs": 2,
        },  # fmt: skip
        "bad": rng.choice(
            [
                {"prompt": prompt, "temperature": -1},
                {"prompt": [5] * 600},
                {"prompt": prompt, "max_tokens": "many"},
                {"prompt": prompt, "n": 0},
            ]
        ),  # fmt: skip
        "stream": {"prompt": prompt, "max_tokens": 24, "stream": True},
        "vanish": {"prompt": prompt, "max_tokens": 64},
    }[kind]


async def _client(url: str, seed: int, deadline: float, seen: dict, budget: list) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            kind = rng.choice(["good", "good", "n", "penalty", "bad", "stream", "vanish"])
            body = _body(rng, kind)
            try:
                if kind == "stream":  # read a few events, then hang up mid-stream
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        status, events = r.status_code, 0
                        async for line in r.aiter_lines():
                            events += line.startswith("data:")
                            if events >= rng.randint(1, 4):
                                break
                elif kind == "vanish":  # give up before the answer comes
                    r = await http.post("/v1/completions", json=body, timeout=rng.uniform(0.01, 0.2))
                    status = r.status_code
                else:
                    r = await http.post("/v1/completions", json=body)
                    status = r.status_code
                    if status == 503:
                        assert r.headers.get("retry-after") == "1", r.headers
                    if status >= 400:
                        assert set(r.json()["error"]) >= {"message", "type", "code"}
            except httpx.TimeoutException:
                status = "gone"
            seen.setdefault(kind, []).append(status)
            if status == 503:
                await asyncio.sleep(rng.uniform(0.1, 0.4))  # busy: come back a little later (sooner than asked)


def test_a_storm_of_mixed_requests_leaves_nothing_behind(llm):
    engine = AsyncLLMEngine(LLMEngine(device="cpu", dtype="float32", max_num_seqs=8, block_size=8, num_blocks=40))
    seen: dict[str, list] = {}
    with serving(engine, max_waiting=6) as (url, _):
        deadline, budget = time.monotonic() + DURATION_S, [MAX_REQUESTS]

        async def storm():
            await asyncio.gather(*(_client(url, seed, deadline, seen, budget) for seed in range(CLIENTS)))

        asyncio.run(storm())
        assert_engine_empty(engine, timeout=30)  # every request finished or aborted, every block free
        metrics = httpx.get(url + "/metrics").text
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            line = next(ln for ln in metrics.splitlines() if ln.startswith(gauge + "{"))
            assert float(line.rsplit(" ", 1)[1]) == 0, line
        r = httpx.post(url + "/v1/completions", json={"prompt": "Romeo.\n", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        want = llm.generate(["Romeo.\n"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].text
        assert r.json()["choices"][0]["text"] == want  # served as before the storm
    statuses = [s for v in seen.values() for s in v]
    assert not [s for s in statuses if isinstance(s, int) and s >= 500 and s != 503], seen  # 503 is the only 5xx
    assert all(s in (400, 422) for s in seen.get("bad", [])), seen["bad"]  # a bad request is a 4xx, never a 503
    assert 200 in seen.get("good", []) and 503 in statuses, seen  # some served, and the queue did overflow


# ---- --request-timeout -------------------------------------------------------------------------------------------
LIMIT_S = 1.5
STEP_DELAY_S = 0.02  # each step made slower: 400 tokens take 8 s, far past the limit; 2 tokens take well under it
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"  # the bundled model has no chat template


def test_a_request_past_request_timeout_is_aborted_and_answered_504(monkeypatch):
    core_engine = LLMEngine(device="cpu", dtype="float32", max_num_seqs=2)
    step = core_engine.step

    def slow_step():
        time.sleep(STEP_DELAY_S)
        return step()

    monkeypatch.setattr(core_engine, "step", slow_step)
    engine = AsyncLLMEngine(core_engine)
    long = {"prompt": "Romeo.\n", "max_tokens": 400, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Romeo."}], "max_tokens": 400, "ignore_eos": True}
    with serving(engine, request_timeout=LIMIT_S, chat_template=TEMPLATE) as (url, _):

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                started = asyncio.Event()
                stream = asyncio.create_task(read_stream(c, long | {"stream": True}, started))
                await started.wait()  # it runs; of the next two one runs beside it, one waits (max_num_seqs=2)
                t0 = time.monotonic()
                plain, chatted = await asyncio.gather(c.post("/v1/completions", json=long),
                                                      c.post("/v1/chat/completions", json=chat))  # fmt: skip
                return await stream, plain, chatted, time.monotonic() - t0

        (status, lines), plain, chatted, waited = asyncio.run(scenario())
        assert waited < LIMIT_S + 3, waited  # answered at the deadline, not when 400 tokens would be done (8 s)
        for r in (plain, chatted):  # the running one and the waiting one alike
            assert_openai_error(r, 504, f"request exceeded --request-timeout {LIMIT_S:g} s")
        assert status == 200 and lines[-1] == "data: [DONE]"  # the stream had started: an error event, then DONE
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == 504 and err["type"] == "GatewayTimeoutError" and "--request-timeout" in err["message"]
        assert 1 < len(lines) - 2 < 400  # some tokens came before the deadline, not all of them
        assert_engine_empty(engine, timeout=2)  # the three requests aborted: every KV block is free again
        metrics = httpx.get(url + "/metrics").text
        assert metric(metrics, "vllm:num_requests_running") == metric(metrics, "vllm:num_requests_waiting") == 0
        assert metric(metrics, "vllm:kv_cache_usage_perc") == 0
        assert metric(metrics, "vllm:request_success_total", finished_reason="abort") == 3
        short = httpx.post(url + "/v1/completions", json={"prompt": "Romeo.\n", "max_tokens": 2}, timeout=60)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2  # within the same limit


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "5s", ""])
def test_request_timeout_refuses_what_is_not_a_positive_number_of_seconds(value, capsys):
    parser = serve_parser(argparse.ArgumentParser(prog="roseinfer").add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["--request-timeout", value])
    assert "argument --request-timeout:" in capsys.readouterr().err
    assert parser.parse_args([]).request_timeout is None  # no limit by default
    assert parser.parse_args(["--request-timeout", "2.5"]).request_timeout == 2.5


def test_until_disconnect_sleeps_until_the_disconnect_message_and_then_cancels_the_work():
    """A request waiting for its answer costs the event loop nothing until its client leaves: one `receive()`
    asleep per request (no polling), and the work cancelled when `http.disconnect` comes."""

    class Client:  # the ASGI side of one request whose body was read: receive() answers only at a disconnect
        def __init__(self):
            self.gone, self.receives = asyncio.Event(), 0

        async def receive(self):
            self.receives += 1
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def scenario():
        client = Client()
        assert await until_disconnect(client, asyncio.sleep(0.01, "answer")) == "answer"
        work = asyncio.ensure_future(asyncio.sleep(60))
        waiting = asyncio.ensure_future(until_disconnect(client, work))
        await asyncio.sleep(0.3)
        assert client.receives == 2 and not waiting.done()  # one receive() per call, asleep: nothing polled
        client.gone.set()
        with pytest.raises(ClientDisconnected):
            await waiting
        assert work.cancelled()  # the engine's requests would be aborted now

    asyncio.run(scenario())


# ---- the overload measurement ---------------------------------------------------------------------------------
def test_the_overload_script_counts_every_answer_and_sees_the_server_back_to_idle(tmp_path):
    """benchmarks/serving/overload.py for a few seconds: a server capped at 4 running and 4 waiting requests is
    offered 4 x 10 req/s of streamed completions; its answers are 200s and 503s with Retry-After only, /health and
    /metrics answered all along, and afterwards the gauges are back to 0. (The "full rate again" check compares two
    2-second windows on a shared machine: recorded, not asserted.)"""
    from benchmarks.serving import overload

    out = tmp_path / "overload.json"
    argv = ["--capacity", "10", "--factor", "4", "--duration", "3", "--check-duration", "2", "--grace", "30",
            "--threads", "1", "--kv-cache-mib", "16", "--max-num-seqs", "4", "--max-waiting", "4",
            "--input-len", "4", "8", "--output-len", "32", "64", "--log", str(tmp_path / "server.log"),
            "--json", str(out)]  # fmt: skip
    status = overload.main(argv)
    rec = json.loads(out.read_text())
    assert status == (0 if rec["holds"] else 1)
    assert rec["command"] == ["python", "benchmarks/serving/overload.py", *argv] and rec["environment"]["cpu"]
    assert rec["capacity"] == {"req_s": 10.0, "measured": False, "rows": []} and rec["overload"]["rate"] == 40.0
    st = rec["overload"]["statuses"]
    assert sum(st["by_status"].values()) == rec["overload"]["row"]["sent"] > 60  # every request was answered
    assert set(st["by_status"]) == {"200", "503"} and st["503_with_retry_after"] == st["by_status"]["503"]
    checks = rec["checks"]
    assert set(checks) == {"no_5xx_but_503", "every_503_has_retry_after", "no_broken_stream", "gauges_back_to_zero",
                           "kv_blocks_all_free", "full_rate_again"}  # fmt: skip
    assert all(ok for name, ok in checks.items() if name != "full_rate_again"), checks
    assert rec["settle"]["gauges"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage_perc": 0.0}
    for path in ("health", "metrics"):
        for phase in overload.PHASES:
            s = rec["poll"][path][phase]
            assert set(s) == {"count", "failed", "p50_ms", "p99_ms", "max_ms"} and s["failed"] == 0
        assert rec["poll"][path]["overload"]["count"] >= 20  # every 50 ms for 3 s and more
    assert rec["poll"]["peak_during_overload"]["waiting"] is not None
    assert rec["poll"]["peak_during_overload"]["established"] >= 1  # the kernel's view of the server's port
    for name in ("before", "after"):
        assert {"achieved_output_tok_s", "p99_ttft_ms", "sustained"} <= set(rec[name])
    wait = rec["overload"]["first_token_wait"]  # where the answered requests waited: the parts add up to TTFT
    assert 0 < wait["requests"] <= st["by_status"]["200"]
    assert all(0 <= wait[part]["p50_ms"] <= wait[part]["p99_ms"] for part in ("in_client", "to_headers",
                                                                             "headers_to_first_token"))  # fmt: skip


# ---- the allocator ------------------------------------------------------------------------------------------------
def test_the_allocator_choice_and_its_errors(monkeypatch):
    assert allocator.find_allocator("system") is None
    with pytest.raises(ValueError, match="unknown allocator 'ptmalloc'"):
        allocator.find_allocator("ptmalloc")
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    assert allocator.find_allocator("auto") is None  # nothing installed: glibc's malloc, no restart
    with pytest.raises(SystemExit, match="--allocator jemalloc: the library jemalloc is not installed"):
        allocator.find_allocator("jemalloc")
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("restarted although nothing to preload"))
    allocator.restart_with_allocator(["serve"], "auto")


def test_a_restarted_process_does_not_restart_again(monkeypatch):
    monkeypatch.setenv(allocator.MARK, "tcmalloc")
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("restarted twice"))
    allocator.restart_with_allocator(["serve"], "auto")


@pytest.mark.skipif(allocator.find_allocator("auto") is None, reason="neither tcmalloc nor jemalloc is installed")
def test_the_server_runs_on_the_preloaded_allocator():
    name, library = allocator.find_allocator("auto")
    with serve_process() as (proc, url):
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # the same pid: the restart replaced the process in place
        assert library.split(".so")[0] in maps, f"{library} is not mapped into the server"
        assert httpx.post(url + "/v1/completions", json={"prompt": "Romeo.", "max_tokens": 2}).status_code == 200
    with serve_process("--allocator", "system") as (proc, url):
        assert library.split(".so")[0] not in Path(f"/proc/{proc.pid}/maps").read_text()


def test_warm_up_builds_every_onednn_primitive_before_the_first_request():
    """oneDNN says in its verbose log when it builds a primitive (a cache miss); benchmarks/engine/onednn_primitives.py
    counts them. After a warm-up, steps of any row count find theirs built; without one, prompts of new lengths build
    new ones (and keep their memory)."""
    args = argparse.Namespace(model_dir=None, threads=2, rounds=2, prompts=12, max_prompt=300)
    cold, warm = (onednn_primitives.run(w, args)["phases"] for w in (False, True))
    built = lambda phases: [p["primitives_built"] for p in phases]  # noqa: E731
    assert [p["phase"] for p in warm] == ["start", "round 1", "round 2"]
    # the bundled GPT-2: 4 kinds of layer at 44 row counts, and the LM head at the 24 of 1 .. max_num_seqs (64)
    assert built(warm) == [4 * 44 + 24, 0, 0]
    assert built(cold)[0] == 0 and sum(built(cold)) > 0


def test_the_warm_up_covers_a_draft_model_too(monkeypatch):
    """With speculative decoding, the draft model's linear layers (another width than the target's) are warmed up
    with the target's: every oneDNN call a step makes afterwards, target or draft, has a shape the warm-up made."""
    import torch

    from roseinfer import LLM

    calls, linear = set(), torch.ops.mkldnn._linear_pointwise

    def noting(x, packed, bias, *post_op):
        out = linear(x, packed, bias, *post_op)
        calls.add((x.shape[0], x.shape[1], out.shape[1], x.dtype, bias is not None, post_op[0], post_op[2]))
        return out

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", noting)
    draft = str(Path(DEFAULT_MODEL).parent / "tiny-shakespeare-draft")  # the bundled draft model: 128 wide
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    with LLM(speculative_config=spec, warmup=True, max_num_seqs=8, max_num_batched_tokens=256,
             linear_backend="onednn") as llm:  # fmt: skip
        warmed = set(calls)
        assert {c[1] for c in warmed} >= {128, 256}  # the draft's width and the target's
        prompts = ["Romeo.\n" * n for n in (1, 3, 7, 20, 45)]
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert calls - warmed == set()


def test_the_server_warms_up_by_default_and_llm_does_not():
    parser = serve_parser(argparse.ArgumentParser(prog="roseinfer").add_subparsers())
    assert EngineArgs.from_cli_args(parser.parse_args([])).warmup is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-warmup"])).warmup is False
    assert EngineArgs().warmup is False
    with pytest.raises(TypeError, match="warmup"):
        EngineArgs(warmup="yes").create_engine_config()
