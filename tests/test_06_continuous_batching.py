"""Stage 06: continuous batching with waiting/running queues, and the LLMEngine API."""

from __future__ import annotations

import pytest
from conftest import core, run_all, run_python

from roseinfer import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture
def solo(llm):
    """A request's tokens when it runs alone (on the session LLM)."""

    def run(prompt, params=GREEDY) -> list[int]:
        return llm.generate([prompt], params, use_tqdm=False)[0].token_ids

    return run


def test_request_added_mid_decode_gets_its_solo_output(make_engine, solo):
    eng = make_engine(max_num_seqs=8)
    eng.add_request("a", "Romeo.\n", GREEDY)
    eng.add_request("b", "Enter Hamlet, reading.\n" * 4, GREEDY)
    for _ in range(6):
        eng.step()
    assert {s.request_id for s in core(eng).scheduler.running} == {"a", "b"}
    eng.add_request("c", "Nurse.\n", GREEDY)  # joins while a and b are mid-decode
    outs = eng.step()
    assert {o.request_id for o in outs} == {"a", "b", "c"}  # one step: c's prefill + a, b decodes
    done = run_all(eng)
    for rid, prompt in [("a", "Romeo.\n"), ("b", "Enter Hamlet, reading.\n" * 4), ("c", "Nurse.\n")]:
        assert done[rid] == solo(prompt), rid


def test_max_num_seqs_is_never_exceeded(make_engine):
    eng = make_engine(max_num_seqs=3)
    eng.trace = []
    lengths = [3, 9, 5, 14, 2, 7, 11, 4]
    for i, n in enumerate(lengths):
        eng.add_request(str(i), f"Request {i}.\n", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done = run_all(eng)
    assert {k: len(v) for k, v in done.items()} == {str(i): n for i, n in enumerate(lengths)}
    assert max(len(t["ran"]) for t in eng.trace) == 3
    assert all(len(t["running"]) <= 3 for t in eng.trace)
    # FCFS: requests start in arrival order
    starts = {}
    for t in eng.trace:
        for rid in t["ran"]:
            starts.setdefault(rid, t["step"])
    assert sorted(starts, key=lambda r: (starts[r], int(r))) == [str(i) for i in range(8)]


def test_finished_request_frees_its_place_at_the_next_step(make_engine):
    eng = make_engine(max_num_seqs=2)
    eng.trace = []
    p = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng.add_request("short", "A.", p(2))
    eng.add_request("long", "B.", p(10))
    eng.add_request("next", "C.", p(3))
    run_all(eng)
    step_of = {rid: next(t["step"] for t in eng.trace if rid in t["ran"]) for rid in ("short", "long", "next")}
    end_short = next(t["step"] for t in eng.trace if "short" in t["finished"])
    assert step_of["next"] == end_short + 1  # takes the freed place immediately


def test_prompt_that_can_never_fit_fails_alone(make_engine, solo):
    eng = make_engine(block_size=4, num_blocks=10)
    eng.add_request("ok", "Romeo.\n", GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("huge", list(range(1, 50)), GREEDY)  # 13 blocks > 10 in the pool
    assert run_all(eng)["ok"] == solo("Romeo.\n")


def test_later_waits_and_fcfs_keeps_order(make_engine, solo):
    eng = make_engine(block_size=4, num_blocks=6, max_num_seqs=8)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("big", list(range(1, 17)), p)  # 4 blocks, grows into a 5th
    eng.add_request("big2", list(range(20, 32)), p)  # 3 blocks: must wait (LATER)
    eng.add_request("small", [5], p)  # would fit, but FCFS: no overtaking
    eng.step()
    assert [s.request_id for s in core(eng).scheduler.running] == ["big"]
    assert [s.request_id for s in core(eng).scheduler.waiting] == ["big2", "small"]
    done = run_all(eng)
    assert done["big2"] == solo(list(range(20, 32)), p)


def test_abort_running_and_waiting_requests(make_engine, solo):
    eng = make_engine(max_num_seqs=2)
    for rid, prompt in [("a", "Romeo.\n"), ("b", "Juliet.\n"), ("c", "Nurse.\n")]:
        eng.add_request(rid, prompt, GREEDY)
    eng.step()
    eng.step()
    assert [r.request_id for r in core(eng).scheduler.running] == ["a", "b"]
    assert [r.request_id for r in core(eng).scheduler.waiting] == ["c"]
    kv = core(eng).kv_cache_manager
    used_before = kv.stats().used_blocks
    eng.abort_request("b")  # running
    eng.abort_request("c")  # waiting
    assert kv.stats().used_blocks < used_before
    assert "b" not in kv.block_tables and "c" not in kv.block_tables
    assert eng.unfinished_request_ids == ["a"] and list(core(eng).scheduler.requests) == ["a"]
    assert run_all(eng) == {"a": solo("Romeo.\n")}
    with pytest.raises(KeyError, match="unknown request id 'b'"):
        eng.abort_request("b")


def test_request_that_cannot_fit_the_pool_even_alone_is_refused(make_engine):
    """Stage 07 changed this: with preemption the pool never deadlocks, as long as every request fits
    alone (prompt + max_tokens). One that cannot is refused at submission; the others are unharmed."""
    eng = make_engine(block_size=4, num_blocks=4)
    eng.add_request("ok", list(range(1, 5)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("a", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(run_all(eng)["ok"]) == 8


def test_duplicate_request_id_is_refused(make_engine):
    eng = make_engine()
    eng.add_request("x", "Romeo.", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", "Juliet.", GREEDY)
    run_all(eng)
    eng.add_request("x", "Juliet.", SamplingParams(max_tokens=2))  # free again once finished
    run_all(eng)


def test_step_deltas_add_up_to_the_text(make_engine, llm):
    eng = make_engine()
    params = SamplingParams(temperature=0, max_tokens=40)
    text, final = {"0": "", "1": ""}, {}
    for out in eng.stream(["Romeo.\n", "Hamlet.\n"], params):
        text[out.request_id] += out.delta
        if out.finished:
            final[out.request_id] = out.text
    assert text == final
    assert final["0"] == llm.generate("Romeo.\n", params, use_tqdm=False)[0].text


def test_llm_generate_runs_on_the_engine_with_max_num_seqs():
    from roseinfer import LLM

    llm = LLM(device="cpu", max_num_seqs=2)
    llm.llm_engine.trace = []
    outs = llm.generate(["Romeo.", "Juliet.", "Nurse.", "Friar."], SamplingParams(temperature=0, max_tokens=8))
    assert [o.prompt for o in outs] == ["Romeo.", "Juliet.", "Nurse.", "Friar."]
    assert all(o.finished for o in outs) and core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0
    assert max(len(t["running"]) for t in llm.llm_engine.trace) == 2


def test_online_example_shows_a_join_mid_flight():
    r = run_python("examples/online_example.py", "--device", "cpu", "--num-requests", "5", "--max-steps", "400")
    assert r.returncode == 0, r.stderr
    assert "joins while" in r.stdout and "TTFT" in r.stdout
