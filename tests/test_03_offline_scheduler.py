"""Stage 03: offline batching behind the LLM API (LLM.generate on LLMEngine)."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, core, greedy_ids, hf_greedy, run_python

from roseinfer import LLM, RequestOutput, SamplingParams


@pytest.fixture
def engine(llm):
    """The session LLM's engine, stepped by hand; it must end the test idle, with its trace off."""
    eng = llm.llm_engine
    yield eng
    eng.trace = None
    for rid in list(eng.output_processor.requests):  # a failed test must not leave requests behind
        eng.abort_request(rid)
    assert core(eng).kv_cache_manager.num_used_blocks == 0, "KV blocks leaked"


def run_all(eng) -> dict[str, RequestOutput]:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_llm_constructor_loads_the_bundled_model():
    llm = LLM(device="cpu")
    assert llm.llm_engine.config.model_config.vocab_size == 4096
    assert llm.generate("Romeo.", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].token_ids


def test_greedy_batch_equals_solo_equals_hf(llm, tokenizer, hf_model):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    eos = tokenizer.eos_token_id
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.token_ids == greedy_ids(llm, ids, 40), prompt
        assert out.token_ids == hf_greedy(hf_model, ids, 40), prompt
        assert out.text == tokenizer.decode([t for t in out.token_ids if t != eos])
        assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")


def test_per_request_params_are_honoured(llm, engine):
    prompts = ["Romeo.\n", "Juliet.\n", "Hamlet.\n", "Lear.\n"]
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=30, seed=1),
        SamplingParams(temperature=0, max_tokens=50, stop=["\n"]),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=17, seed=2, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs[0].token_ids) == 5 and outs[0].finish_reason == "length"
    assert len(outs[3].token_ids) == 17
    assert "\n" not in outs[2].text and outs[2].finish_reason == "stop"
    for prompt, p, out in zip(prompts, params, outs, strict=True):  # each equals its solo run
        solo = llm.generate(prompt, p, use_tqdm=False)[0]
        assert (solo.token_ids, solo.text) == (out.token_ids, out.text)
        assert "".join(o.delta for o in engine.stream([prompt], p)) == out.text  # streamed alone


def test_outputs_keep_prompt_order_and_ids(llm):
    prompts = ["a" * n for n in (30, 1, 12, 5)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in (2, 9, 4, 6)], use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)


def test_token_id_prompts(llm):
    text = "Enter Macbeth.\n"
    ids = llm.tokenizer.encode(text)
    p = SamplingParams(temperature=0, max_tokens=20)
    by_text, by_ids = llm.generate([text, ids], p, use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text
    assert llm.generate(ids, p, use_tqdm=False)[0].token_ids == by_text.token_ids  # a single id list


@pytest.fixture(scope="module")
def solo12(llm):
    return {p: greedy_ids(llm, p, 12) for p in ("Romeo.\n", "Hamlet.\n")}


@pytest.mark.parametrize(
    ("bad", "match"),
    [("", "empty"), ([], "empty"), ([1, 99999], "outside the vocabulary"), ("the " * 600, "context"), (3.5, "prompt")],
)
def test_invalid_request_raises_at_submission_and_others_are_unharmed(solo12, engine, bad, match):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    engine.add_request("a", "Romeo.\n", greedy)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request("bad", bad, greedy)
    assert "bad" not in core(engine).scheduler.requests and "bad" not in engine.output_processor.requests
    engine.add_request("b", "Hamlet.\n", greedy)
    engine.step()  # both mid-flight
    assert {r.request_id for r in core(engine).scheduler.running} == {"a", "b"}
    out = run_all(engine)
    assert set(out) == {"a", "b"}
    assert out["a"].token_ids == solo12["Romeo.\n"]
    assert out["b"].token_ids == solo12["Hamlet.\n"]


def test_llm_generate_names_the_bad_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1: .*empty"):
        llm.generate(["Romeo.", "", "Juliet."], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_scheduler_steps_round_robin(engine):
    engine.trace = []
    ids = ["r0", "r1", "r2"]
    for rid, (p, m) in zip(ids, [("Romeo.", 2), ("Juliet.", 4), ("Nurse.", 3)], strict=True):
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    ran = []
    while engine.has_unfinished_requests():
        got = [o.request_id for o in engine.step()]
        ran.append(engine.trace[-1]["ran"])
        assert sorted(got) == sorted(ran[-1])  # every request that ran got a token
    # every request once per step, in arrival order; request 0 is done after 2 tokens, request 2 after 3
    assert ran == [ids, ids, ids[1:], [ids[1]]]


def test_offline_example_prints_every_request():
    prompts = ["Romeo.", "Juliet.", "Nurse."]
    r = run_python("examples/offline_example.py", "--device", "cpu", "--max-tokens", "6", "--prompts", *prompts)
    assert r.returncode == 0, r.stderr
    for i in range(3):
        assert f"### request {i}\n{prompts[i]}" in r.stdout
