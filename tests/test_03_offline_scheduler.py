"""Stage 03: the offline scheduler and the LLM API."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, hf_greedy, run_python

from roseinfer import LLM, RequestOutput, SamplingParams
from roseinfer.scheduler import OfflineScheduler


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


def test_llm_constructor_loads_the_bundled_model():
    llm = LLM(device="cpu")
    assert llm.engine.config.vocab_size == 4096
    assert llm.generate("Romeo.", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].token_ids


def test_greedy_batch_equals_solo_equals_hf(llm, engine, hf_model):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = engine.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.token_ids == engine.generate_ids(ids, max_new_tokens=40), prompt
        assert out.token_ids == hf_greedy(hf_model, ids, 40), prompt
        assert out.text == engine.tokenizer.decode([t for t in out.token_ids if t != engine.eos_token_id])
        assert out.finish_reason == ("stop" if out.token_ids[-1] == engine.eos_token_id else "length")


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
        assert "".join(engine.stream(prompt, p)) == out.text


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


@pytest.mark.parametrize(
    ("bad", "match"),
    [("", "empty"), ([], "empty"), ([1, 99999], "outside the vocabulary"), ("the " * 600, "context"), (3.5, "prompt")],
)
def test_invalid_request_raises_at_submission_and_others_are_unharmed(engine, bad, match):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    sched = OfflineScheduler(engine)
    a = sched.add_request("Romeo.\n", greedy)
    with pytest.raises((ValueError, TypeError), match=match):
        sched.add_request(bad, greedy)
    b = sched.add_request("Hamlet.\n", greedy)
    sched.step()  # both mid-flight
    out = sched.run()
    assert set(out) == {a, b}
    assert out[a].token_ids == engine.generate_ids(engine.tokenizer.encode("Romeo.\n"), 12)
    assert out[b].token_ids == engine.generate_ids(engine.tokenizer.encode("Hamlet.\n"), 12)


def test_llm_generate_names_the_bad_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1: .*empty"):
        llm.generate(["Romeo.", "", "Juliet."], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_scheduler_steps_round_robin(engine):
    sched = OfflineScheduler(engine)
    ids = [sched.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)) for p, m in
           [("Romeo.", 2), ("Juliet.", 4), ("Nurse.", 3)]]  # fmt: skip
    assert sched.step() == ids  # every request once per step, in arrival order
    assert sched.step() == ids
    assert sched.step() == ids[1:]  # request 0 is done after 2 tokens
    assert sched.step() == [ids[1]]
    assert not sched.has_unfinished()


def test_offline_example_prints_every_request():
    prompts = ["Romeo.", "Juliet.", "Nurse."]
    r = run_python("scripts/offline_example.py", "--device", "cpu", "--max-tokens", "6", "--prompts", *prompts)
    assert r.returncode == 0, r.stderr
    for i in range(3):
        assert f"### request {i}\n{prompts[i]}" in r.stdout
