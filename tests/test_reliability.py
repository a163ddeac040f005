"""Reliability: bad input gets a clear error and harms nobody; random traffic keeps every invariant."""

from __future__ import annotations

import pytest
from conftest import make_random_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_num_seqs=8)


def _after_error_all_is_well(llm: LLM) -> None:
    """A valid request right after the error works, and no KV block is held."""
    out = llm.generate(["Romeo.\n"], GREEDY, use_tqdm=False)[0]
    assert out.finished and len(out.token_ids) >= 1
    assert llm.block_manager.stats().used_blocks == 0
    assert not llm.llm_engine.has_unfinished_requests()


BAD_GENERATE_CALLS = [
    ("empty prompt", lambda: ([""], None), ValueError, "empty"),
    ("empty token list", lambda: ([[]], None), ValueError, "empty"),
    ("None prompt", lambda: ([None], None), TypeError, "prompt must be"),
    ("wrong prompt type", lambda: ([3.5], None), TypeError, "prompt must be"),
    ("prompts not a list", lambda: ({"a": 1}, None), TypeError, "prompts must be"),
    ("token ids with a str", lambda: ([[1, "2", 3]], None), TypeError, "prompt must be"),
    ("token id outside the vocabulary", lambda: ([[1, 4096]], None), ValueError, "outside the vocabulary"),
    ("negative token id", lambda: ([[-1, 5]], None), ValueError, "outside the vocabulary"),
    ("prompt longer than the context", lambda: (["the " * 600], None), ValueError, "context"),
    ("params list of the wrong length", lambda: (["a", "b"], [GREEDY]), ValueError, "one per prompt"),
    ("params of the wrong type", lambda: (["a"], [{"temperature": 0}]), ValueError, "sampling_params"),
]


@pytest.mark.parametrize(("name", "make", "exc", "match"), BAD_GENERATE_CALLS, ids=[c[0] for c in BAD_GENERATE_CALLS])
def test_bad_generate_input(llm, name, make, exc, match):
    prompts, params = make()
    with pytest.raises(exc, match=match):
        llm.generate(["Juliet.\n", *prompts] if isinstance(prompts, list) else prompts, params, use_tqdm=False)
    _after_error_all_is_well(llm)


BAD_PARAMS = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": [None]}, "stop"),
    ({"stop_token_ids": "eos"}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), BAD_PARAMS, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_PARAMS)]
)
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    _after_error_all_is_well(llm)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model="./no/such/model", device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(model="/tmp/definitely/not/a/model", device="cpu")


def test_engine_level_errors_leave_other_requests_correct(llm):
    eng = llm.llm_engine
    eng.add_request("a", "Romeo.\n", GREEDY)
    eng.step()
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", "Juliet.\n", GREEDY)
    with pytest.raises(KeyError, match="unknown request id"):
        eng.abort_request("nobody")
    with pytest.raises(ValueError, match="KV blocks"):  # a request that could never fit the pool
        LLMEngine(device="cpu", block_size=4, num_blocks=2).add_request("x", list(range(1, 20)), GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done["a"] == list(eng.engine.token_stream(eng.engine.encode_prompt("Romeo.\n"), GREEDY))
    _after_error_all_is_well(llm)


# ---- random traffic ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7, n_positions=64, n_embd=64, n_layer=2)


request = st.tuples(
    st.integers(0, 3),  # arrives after this many steps
    st.lists(st.integers(0, 4094), min_size=1, max_size=20),  # prompt
    st.integers(1, 24),  # max_tokens
    st.booleans(),  # aborted after a few steps?
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request, min_size=1, max_size=8),
    num_blocks=st.integers(11, 24),
    max_num_seqs=st.integers(1, 4),
)
def test_random_traffic_keeps_every_invariant(tiny_model, reqs, num_blocks, max_num_seqs):
    eng = LLMEngine(tiny_model, device="cpu", dtype="float32", block_size=4, num_blocks=num_blocks,
                    max_num_seqs=max_num_seqs)  # fmt: skip
    pending = [(gap, str(i), prompt, n, abort) for i, (gap, prompt, n, abort) in enumerate(reqs)]
    done, step, abort_at = {}, 0, {}
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= 0:
            _, rid, prompt, n, abort = pending.pop(0)
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            if abort:
                abort_at[rid] = step + 2
        pending = [(gap - 1, *rest) for gap, *rest in pending]
        for rid, when in list(abort_at.items()):
            if when == step and rid in eng.sessions:
                eng.abort_request(rid)
                assert rid not in eng.block_manager.block_tables
        if eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        assert len(eng.scheduler.running) <= max_num_seqs
        step += 1
    assert eng.block_manager.stats().used_blocks == 0, "KV blocks leaked"
    for _, rid, prompt, n, _ in [(0, str(i), p, n, a) for i, (_, p, n, a) in enumerate(reqs)]:
        if rid in done and rid not in abort_at:
            solo = list(eng.engine.token_stream(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
            assert done[rid] == solo, rid
        elif rid not in abort_at:
            raise AssertionError(f"request {rid} never finished")


def test_batch_invariance_alone_and_among_64_others(llm):
    target = "Enter Hamlet, reading.\n"
    alone = llm.generate([target], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].token_ids
    crowd = LLM(device="cpu", dtype="float32", max_num_seqs=65)
    others = [f"Lord {i}.\n" + "speak " * (i % 13) for i in range(64)]
    prompts = others[:32] + [target] + others[32:]
    outs = crowd.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert outs[32].token_ids == alone
    assert crowd.block_manager.stats().used_blocks == 0
