"""Reliability: bad input gets a clear error and harms nobody; random traffic keeps every invariant."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from conftest import core, greedy_ids, make_random_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer import LLM, EngineArgs, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_num_seqs=8)


def _after_error_all_is_well(llm: LLM) -> None:
    """A valid request right after the error works, and no KV block is held."""
    out = llm.generate(["Romeo.\n"], GREEDY, use_tqdm=False)[0]
    assert out.finished and len(out.token_ids) >= 1
    assert core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0
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
    ({"temperature": INF}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"seed": 2**70}, "seed"),  # torch.Generator takes [-2**63, 2**64 - 1]
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": None}, "ignore_eos"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), BAD_PARAMS, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_PARAMS)]
)
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    _after_error_all_is_well(llm)


# ---- every constructor argument: zero, negative, huge, wrong type, a bool for an int, nan, inf -------------------
BAD_ENGINE_ARGS = [  # (argument, bad value, error); the message must name the argument
    ("model", 3, TypeError), ("model", b"gpt2", TypeError), ("model", "", ValueError),
    ("device", "gpu", ValueError), ("device", 3, TypeError), ("device", None, TypeError),
    ("device", "meta", ValueError), ("device", "", ValueError), ("device", "cuda:99", ValueError),
    ("dtype", "int8", ValueError), ("dtype", 3, TypeError), ("dtype", torch.int64, ValueError),
    ("block_size", 0, ValueError), ("block_size", -1, ValueError), ("block_size", 1.5, TypeError),
    ("block_size", True, TypeError), ("block_size", "16", TypeError), ("block_size", None, TypeError),
    ("block_size", 10**6, ValueError),  # larger than the model's context
    ("num_blocks", 0, ValueError), ("num_blocks", -1, ValueError), ("num_blocks", 2.0, TypeError),
    ("num_blocks", True, TypeError), ("num_blocks", "4", TypeError), ("num_blocks", 2**62, ValueError),
    ("kv_cache_memory", 0, ValueError), ("kv_cache_memory", -1, ValueError), ("kv_cache_memory", 1.5, TypeError),
    ("kv_cache_memory", True, TypeError), ("kv_cache_memory", "4", TypeError),
    ("kv_cache_memory", 2**70, ValueError), ("kv_cache_memory", 1, ValueError),  # more than memory; not one block
    ("gpu_memory_utilization", 0, ValueError), ("gpu_memory_utilization", -0.5, ValueError),
    ("gpu_memory_utilization", NAN, ValueError), ("gpu_memory_utilization", INF, ValueError),
    ("gpu_memory_utilization", 1.5, ValueError), ("gpu_memory_utilization", True, TypeError),
    ("gpu_memory_utilization", "0.5", TypeError), ("gpu_memory_utilization", None, TypeError),
    ("attention_backend", "TORCH", ValueError), ("attention_backend", 3, TypeError),
    ("attention_backend", None, TypeError),
    ("linear_backend", "MKL", ValueError), ("linear_backend", 3, TypeError), ("linear_backend", None, TypeError),
    ("custom_ops", "fused", ValueError), ("custom_ops", 3, TypeError), ("custom_ops", None, TypeError),
    ("kv_cache_dtype", "int4", ValueError), ("kv_cache_dtype", "fp8_e5m2", ValueError),
    ("kv_cache_dtype", None, TypeError), ("kv_cache_dtype", torch.float8_e4m3fn, TypeError),
    ("max_num_seqs", 0, ValueError), ("max_num_seqs", -1, ValueError), ("max_num_seqs", 1.5, TypeError),
    ("max_num_seqs", True, TypeError), ("max_num_seqs", "4", TypeError), ("max_num_seqs", None, TypeError),
    ("max_num_batched_tokens", 0, ValueError), ("max_num_batched_tokens", -1, ValueError),
    ("max_num_batched_tokens", 1.5, TypeError), ("max_num_batched_tokens", True, TypeError),
    ("max_num_batched_tokens", "64", TypeError),
    ("max_model_len", 0, ValueError), ("max_model_len", 10**6, ValueError), ("max_model_len", 1.5, TypeError),
    ("max_model_len", "64", TypeError),
    ("enable_chunked_prefill", "yes", TypeError), ("enable_chunked_prefill", 1, TypeError),
    ("enable_chunked_prefill", None, TypeError),
    ("enable_prefix_caching", "yes", TypeError), ("enable_prefix_caching", 1, TypeError),
    ("enable_prefix_caching", None, TypeError),
    ("watermark", -0.1, ValueError), ("watermark", 1, ValueError), ("watermark", NAN, ValueError),
    ("watermark", True, TypeError), ("watermark", "0.01", TypeError), ("watermark", None, TypeError),
    ("preemption_mode", "drop", ValueError), ("preemption_mode", "SWAP", ValueError),
    ("preemption_mode", 1, ValueError),
    ("swap_space", -1, ValueError), ("swap_space", INF, ValueError), ("swap_space", NAN, ValueError),
    ("swap_space", 2**40, ValueError), ("swap_space", True, TypeError), ("swap_space", "4", TypeError),
    ("swap_space", None, TypeError),
    ("speculative_config", 3, TypeError), ("speculative_config", "ngram", TypeError),
    ("speculative_config", {"method": "magic", "num_speculative_tokens": 2}, ValueError),
    ("speculative_config", {"method": "ngram"}, ValueError),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2, "k": 3}, ValueError),
    ("tensor_parallel_size", 0, ValueError), ("tensor_parallel_size", -1, ValueError),
    ("tensor_parallel_size", 1.5, TypeError), ("tensor_parallel_size", True, TypeError),
    ("tensor_parallel_size", "2", TypeError), ("tensor_parallel_size", None, TypeError),
    ("tensor_parallel_size", 10**6, ValueError),  # more ranks than CPU cores
    ("enforce_eager", "yes", TypeError), ("enforce_eager", 1, TypeError), ("enforce_eager", None, TypeError),
    ("async_scheduling", "yes", TypeError), ("async_scheduling", 1, TypeError), ("async_scheduling", None, TypeError),
    ("warmup", "yes", TypeError), ("warmup", 1, TypeError), ("warmup", None, TypeError),
]  # fmt: skip
ENGINE_CASES = [(cls, arg, value, exc) for cls in (LLM, LLMEngine) for arg, value, exc in BAD_ENGINE_ARGS]


def test_every_engine_argument_has_bad_values_tested():
    """The list above covers every EngineArgs field (the arguments of LLM, LLMEngine and `roseinfer serve`)."""
    assert {a for a, _, _ in BAD_ENGINE_ARGS} == {f.name for f in fields(EngineArgs)}


@pytest.mark.parametrize(
    ("cls", "arg", "value", "exc"), ENGINE_CASES, ids=[f"{c.__name__}-{a}={v!r}"[:60] for c, a, v, _ in ENGINE_CASES]
)
def test_bad_constructor_argument_is_named(cls, arg, value, exc):
    with pytest.raises(exc, match=arg):
        cls(**{"device": "cpu", arg: value})


@pytest.mark.parametrize("cls", [LLM, LLMEngine])
def test_unknown_constructor_argument_is_a_type_error_naming_it(cls):
    with pytest.raises(TypeError, match="use_kv_cache"):  # the no-KV-cache loop of stages 01-02 is gone
        cls(device="cpu", use_kv_cache=False)


def test_edge_values_that_are_valid(llm):
    """Huge top_k means all tokens, the whole seed range works, a tiny temperature is greedy,
    no prompts give no outputs, and a list may mix text and token ids."""
    out = lambda prompts, **kw: [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, **kw),
                                                                   use_tqdm=False)]  # fmt: skip
    assert out(["Romeo.\n"], top_k=2**70, seed=3) == out(["Romeo.\n"], top_k=-1, seed=3)
    assert all(out(["Romeo.\n"], seed=s) for s in (-(2**63), -1, 2**64 - 1))
    assert out(["Romeo.\n"], temperature=1e-45) == out(["Romeo.\n"], temperature=0)
    assert llm.generate([], GREEDY, use_tqdm=False) == [] and llm.generate([], use_tqdm=False) == []
    ids = llm.tokenizer.encode("Enter Ghost.\n")
    mixed = llm.generate(["Romeo.\n", ids, "Juliet.\n"], GREEDY, use_tqdm=False)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in ("Romeo.\n", ids, "Juliet.\n")]
    assert [m.token_ids for m in mixed] == [a.token_ids for a in alone]
    assert mixed[1].prompt is None and mixed[1].prompt_token_ids == ids
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
    assert done["a"] == greedy_ids(llm, "Romeo.\n", GREEDY.max_tokens)  # the same tokens as alone
    _after_error_all_is_well(llm)


# ---- random traffic ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7, n_positions=64, n_embd=64, n_layer=2)


@pytest.fixture(scope="module")
def tiny_solo(tiny_model):
    """Each request alone on the tiny model (no batching, no preemption, no speculation): its greedy tokens."""
    solo, cache = LLM(tiny_model, device="cpu", dtype="float32"), {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = greedy_ids(solo, prompt, max_tokens, ignore_eos=True)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Stage 14: another random model with the same vocabulary, as a draft (its guesses are mostly wrong)."""
    return make_random_checkpoint(tmp_path_factory.mktemp("draft"), seed=8, n_positions=64, n_embd=32, n_layer=1)


request = st.tuples(
    st.integers(0, 3),  # arrives after this many steps
    st.lists(st.integers(0, 4094), min_size=1, max_size=20),  # prompt
    st.integers(1, 24),  # max_tokens
    st.booleans(),  # aborted after a few steps?
    st.sampled_from([1, 1, 2, 3]),  # stage 11: n completions
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request, min_size=1, max_size=8),
    num_blocks=st.integers(11, 24),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 30),  # stage 09: tokens per step; small budgets cut prompts into chunks
    mode=st.sampled_from([None, "recompute", "swap"]),  # stage 12: how to preempt
    swap_blocks=st.integers(0, 16),  # stage 12: host pool size, in blocks (0: swaps fall back to recompute)
    spec=st.sampled_from([None, "ngram", "draft", "self", "async"]),  # stage 14: which proposer; stage 16: or async
    k=st.integers(1, 5),
)
def test_random_traffic_keeps_every_invariant(tiny_model, tiny_solo, tiny_draft, reqs, num_blocks, max_num_seqs, budget,
                                              mode, swap_blocks, spec, k):  # fmt: skip
    spec_config = {"method": "ngram", "num_speculative_tokens": k} if spec == "ngram" else None
    if spec in ("draft", "self"):  # a wrong draft, or the target itself (every guess right)
        spec_config = {"method": "draft_model", "num_speculative_tokens": k,
                       "model": str(tiny_draft if spec == "draft" else tiny_model)}  # fmt: skip
    eng = LLMEngine(tiny_model, device="cpu", dtype="float32", block_size=4, num_blocks=num_blocks,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode,
                    swap_space=swap_blocks * 4 * kv_bytes_per_token(tiny_model) / 2**30,
                    speculative_config=spec_config, async_scheduling=spec == "async")  # fmt: skip
    eng.trace = []
    pending = [(gap, str(i), prompt, n, abort, k) for i, (gap, prompt, n, abort, k) in enumerate(reqs)]
    done, step, abort_at, refused = {}, 0, {}, set()
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= 0:
            _, rid, prompt, n, abort, k = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, n=min(k, max_num_seqs))
            try:
                eng.add_request(rid, prompt, params)
            except ValueError as e:  # n sequences that could never fit the pool together
                assert "whole KV cache pool" in str(e) and params.n > 1
                refused.add(rid)
                continue
            if abort:
                abort_at[rid] = step + 2
        pending = [(gap - 1, *rest) for gap, *rest in pending]
        for rid, when in list(abort_at.items()):
            if when == step and rid in eng.output_processor.requests:
                eng.abort_request(rid)
                kv = core(eng).kv_cache_manager
                assert not any(s == rid or s.startswith(rid + "#") for s in [*kv.block_tables, *kv.cpu_tables])
                assert not any(s == rid or s.startswith(rid + "#") for s in core(eng).scheduler.requests)
        if eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
        assert len(core(eng).scheduler.running) <= max_num_seqs
        assert not eng.trace or sum(eng.trace[-1]["num_scheduled_tokens"].values()) <= budget
        step += 1
        assert step < 2000, "the engine stopped making progress"
    kv = core(eng).kv_cache_manager  # the draft model has no pool of its own: it writes into the target's blocks
    assert kv.stats().used_blocks == 0 and len(kv.cpu_pool.free) == kv.num_cpu_blocks, "KV blocks leaked"
    assert not core(eng).scheduler.requests and not kv.block_tables and not kv.cpu_tables
    eng.step()  # the runner drops the rows of requests that finished in the last step at the next one
    runner = core(eng).model_runner
    assert not runner.input_batch.requests and not runner.input_batch.req_id_to_row, "runner rows leaked"
    if spec in ("draft", "self"):
        assert not runner.proposer.computed and not runner.proposer.fed, "draft state leaked"
    for i, (_, prompt, n, _, k) in enumerate(reqs):
        rid = str(i)
        if rid in done and rid not in abort_at:
            assert done[rid] == [tiny_solo(prompt, n)] * min(k, max_num_seqs), rid
        elif rid not in abort_at and rid not in refused:
            raise AssertionError(f"request {rid} never finished")


def kv_bytes_per_token(model_dir) -> int:
    """K and V of one token, all layers, fp32: what a block of the host pool holds per token."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["n_layer"] * cfg["n_embd"] * 4


def test_batch_invariance_alone_and_among_64_others(llm):
    target = "Enter Hamlet, reading.\n"
    alone = llm.generate([target], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].token_ids
    crowd = LLM(device="cpu", dtype="float32", max_num_seqs=65)
    others = [f"Lord {i}.\n" + "speak " * (i % 13) for i in range(64)]
    prompts = others[:32] + [target] + others[32:]
    outs = crowd.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert outs[32].token_ids == alone
    assert core(crowd.llm_engine).kv_cache_manager.stats().used_blocks == 0
