"""Stage 19: a request that fails inside the engine fails alone. Its caller gets finish_reason "error" and why,
its blocks are freed (and leave the prefix cache), and every other request goes on, token for token: whether
the runner cannot set it up, or the step raises whenever it is in it (the step runs again in halves)."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import PROMPTS, core
from test_19_sampling_features import GREEDY, MIXED, V, alone, greedy, ids_of, same, summary

from roseinfer import LLM, RequestOutputKind, SamplingParams
from roseinfer.core.request import Request
from roseinfer.entrypoints.async_engine import AsyncLLMEngine, _RequestState
from roseinfer.entrypoints.stats import RequestStateStats


@pytest.fixture(scope="module")
def mixed_alone(llm):
    return alone(llm, PROMPTS, MIXED)


def bad_request(eng, rid: str, prompt: list[int], **params) -> None:
    """A request past admission's checks (as a bug would let one through): a logit_bias id outside the vocabulary,
    which only the model runner trips over."""
    mc = eng.config.model_config
    p = SamplingParams(**GREEDY | params)
    p.logit_bias = {V + 5: 1.0}
    eng.engine_core.add_request(Request(rid, prompt, p, mc.eos_token_ids, mc.max_model_len))
    eng.output_processor.add_request(rid, None, prompt, p)


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_that_fails_in_the_runner_fails_alone(make_engine, llm, tokenizer, n):
    prompts = ids_of(tokenizer, PROMPTS[:3])
    want = greedy(llm, prompts)
    eng = make_engine(max_num_seqs=8)
    eng.add_request("a", prompts[0], SamplingParams(**GREEDY))
    eng.step()  # "a" runs, then the bad one arrives with another good one
    bad_request(eng, "bad", prompts[1], n=n)
    eng.add_request("b", prompts[2], SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    bad = done.pop("bad")
    assert bad.finish_reason == "error" and "'bad'" in bad.error and "logit_bias [4101] are outside" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"] * n
    assert {k: o.token_ids for k, o in done.items()} == {"a": want[0], "b": want[2]}
    assert (
        not core(eng).model_runner.failures and "bad" not in core(eng).scheduler.requests
    )  # (make_engine checks the blocks)


def test_async_engine_raises_for_a_request_that_failed_alone(make_engine, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    eng = make_engine()

    async def scenario():
        engine = AsyncLLMEngine(eng)

        async def good():
            return [o async for o in engine.generate(prompt, SamplingParams(**GREEDY), "good")][-1]

        async def bad():
            bad_request(eng, "bad", prompt)
            state = _RequestState(asyncio.Queue(), RequestStateStats(time.perf_counter(), RequestOutputKind.CUMULATIVE))
            engine._requests["bad"] = state  # as generate() registers a request
            engine._wake.set()
            return await state.queue.get()

        engine.start()
        out, err = await asyncio.gather(good(), bad())
        await engine.shutdown()
        return out, err

    out, err = asyncio.run(scenario())
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 20
    assert isinstance(err, RuntimeError) and "logit_bias [4101] are outside the vocabulary" in str(err)


def test_a_failing_step_is_run_again_in_halves_and_only_the_culprit_fails(make_engine, llm, tokenizer, monkeypatch):
    """The forward raises whenever "poison" is in the step (after its third token): the step is run again in
    halves until "poison" runs alone and fails; every other request goes on, token for token."""
    prompts = ids_of(tokenizer, PROMPTS[:5])
    want = greedy(llm, prompts)
    eng = make_engine(max_num_seqs=8)
    runner = core(eng).model_runner
    forward = runner._forward

    def flaky(step):
        row = runner.input_batch.req_id_to_row.get("poison")
        if row is not None and row in step.rows and runner.input_batch.num_tokens[row] >= len(prompts[2]) + 3:
            raise RuntimeError("boom")
        return forward(step)

    monkeypatch.setattr(runner, "_forward", flaky)
    for i, p in enumerate(prompts):
        eng.add_request("poison" if i == 2 else str(i), p, SamplingParams(**GREEDY))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    bad = done.pop("poison")
    assert bad.finish_reason == "error" and "RuntimeError: boom" in bad.error and len(bad.token_ids) == 3
    assert bad.token_ids == want[2][:3]
    assert {k: o.token_ids for k, o in done.items()} == {str(i): want[i] for i in (0, 1, 3, 4)}


def test_a_step_that_fails_once_loses_nobody(mixed_alone, monkeypatch):
    """The sampler raises once, in a step of many requests (after the forward, the prompt log-probabilities, the
    forks of n > 1): the step runs again in halves, and every request ends as it would have."""
    llm = LLM(device="cpu", dtype="float32")
    runner = core(llm.llm_engine).model_runner
    sample, failures = runner._sample, []

    def once(logits, req_ids, *args):
        if len(req_ids) >= 6 and not failures:
            failures.append(list(req_ids))
            raise RuntimeError("transient")
        return sample(logits, req_ids, *args)

    monkeypatch.setattr(runner, "_sample", once)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert failures and same([summary(o) for o in outs], mixed_alone)


@pytest.mark.parametrize("how", ["setup", "forward", "async"])
def test_requests_that_read_blocks_a_failed_request_never_wrote_fail_too(make_engine, llm, tokenizer, monkeypatch,
                                                                         how):  # fmt: skip
    """A request ("twin") gets a prefix-cache hit on the blocks "bad" is writing in the same step (or, with async
    scheduling, in the step before, scheduled before "bad" was known to fail): when "bad" fails (its setup, or
    every forward it is in), "twin" fails with it instead of reading garbage; the blocks leave the prefix cache,
    so a later request with that prompt computes them again."""
    prompt, other = tokenizer.encode(PROMPTS[4]), tokenizer.encode(PROMPTS[0])
    want, want_other = greedy(llm, [prompt, other])
    eng = make_engine(block_size=4, enable_prefix_caching=True, async_scheduling=how == "async")
    runner = core(eng).model_runner
    if how == "forward":
        forward = runner._forward

        def flaky(step):
            if runner.input_batch.req_id_to_row.get("bad") in step.rows:
                raise RuntimeError("boom")
            return forward(step)

        monkeypatch.setattr(runner, "_forward", flaky)
        eng.add_request("bad", prompt, SamplingParams(**GREEDY))
    else:
        bad_request(eng, "bad", prompt)
    if how == "async":
        assert eng.step() == []  # "bad" fails in the step launched now; its failure is known one step later
    eng.add_request("twin", prompt, SamplingParams(**GREEDY))
    eng.add_request("other", other, SamplingParams(**GREEDY))
    done = run_outputs(eng)
    assert done["twin"].num_cached_tokens >= 16  # it shared the full blocks "bad" was writing
    assert done["bad"].finish_reason == done["twin"].finish_reason == "error"
    assert ("boom" if how == "forward" else "failed to write") in done["twin"].error
    assert done["other"].token_ids == want_other
    eng.add_request("later", prompt, SamplingParams(**GREEDY))
    later = run_outputs(eng)["later"]
    assert later.token_ids == want and later.num_cached_tokens == 0


def run_outputs(eng) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return done


def test_a_request_fails_alone_under_tensor_parallelism(llm, tokenizer):
    """Every rank sets up the same rows, so every rank leaves the same request out, and the forward goes on."""
    from roseinfer import LLMEngine

    prompts = ids_of(tokenizer, PROMPTS[:3])
    want = greedy(llm, prompts[:2])
    eng = LLMEngine(device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        eng.add_request("a", prompts[0], SamplingParams(**GREEDY, logprobs=1))
        bad_request(eng, "bad", prompts[2])
        eng.add_request("b", prompts[1], SamplingParams(**GREEDY))
        done = run_outputs(eng)
        assert done["bad"].finish_reason == "error" and "logit_bias" in done["bad"].error
        assert [done["a"].token_ids, done["b"].token_ids] == want
        assert core(eng).kv_cache_manager.stats().used_blocks == 0
    finally:
        eng.close()
