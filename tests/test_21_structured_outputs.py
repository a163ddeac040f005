"""Stage 21: structured outputs in the engine. Constraints compile with xgrammar, each step's bitmask masks the
constrained rows' logits, the sampled tokens move each request's matcher; every output follows its constraint,
through every path a request can take (batched, chunked, cached, n > 1, speculation, async, preemption, TP = 2)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future

import pytest
import torch
from conftest import core, run_all

from roseinfer import LLM, SamplingParams, StructuredOutputsParams
from roseinfer.sample.grammar_bitmask import apply_token_bitmask, apply_token_bitmask_reference, unpack_bitmask

LLAMA = "roseinfer/models/tiny-llama-shakespeare"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
PARENS = 'root ::= "(" [a-z]{1,8} ("," [a-z]{1,8}){0,2} ")"'
PROMPTS = ["ROMEO:", "JULIET: what", "First Citizen:", "KING", "O, what a rogue"]


def cases() -> list[StructuredOutputsParams]:
    return [
        StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
        StructuredOutputsParams(regex=DATE),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar=PARENS),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    ]


def check(so: StructuredOutputsParams, text: str, finish_reason: str) -> None:
    """The output follows its constraint: complete (the grammar ended it), or for a JSON object, which these tiny
    models write as one endless string key, cut by max_tokens and then the start of an object that closes."""
    if so.kind == "json_object" and finish_reason == "length":
        assert text.startswith("{") and any(is_object(text + end) for end in ('"}', '":0}', "}", '":0}', "0}", '"]}'))
        return
    assert finish_reason == "stop", (so.kind, text, finish_reason)
    if so.kind == "json":
        import jsonschema  # (imported here: the GPU machine's python runs this file's cuda test without it)

        jsonschema.validate(json.loads(text), so.json)
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice, text
    else:
        assert re.fullmatch(r"\([a-z]{1,8}(,[a-z]{1,8}){0,2}\)", text), text


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def params(so, temperature=0.0, seed=None, max_tokens=60, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so, **kw)


def every_case(llm, temperature=0.0, n=1) -> list:
    """Each case on each prompt, in one batch; returns the outputs after checking them all."""
    todo = [(so, p) for so in cases() for p in PROMPTS[:2]]
    outs = llm.generate([p for _, p in todo], [params(so, temperature, seed=i, n=n) for i, (so, _) in
                                               enumerate(todo)], use_tqdm=False)  # fmt: skip
    for (so, _), o in zip(todo, outs, strict=True):
        for c in o.outputs:
            check(so, c.text, c.finish_reason)
    return outs


def ids(outs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def gpt2():
    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llama():
    return LLM(LLAMA, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(gpt2):
    """Greedy constrained ids of the plain engine: what every other path must reproduce."""
    return ids(every_case(gpt2))


# ---- the parameters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, "You must use one kind of structured outputs constraint"),
        ({"json": PERSON, "regex": DATE}, r"but multiple are specified: \['json', 'regex'\]"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 3]}, "choice must be a non-empty list of strings"),
        ({"json": 3}, "json must be a JSON schema"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": False}, "json_object must be True or None"),
        ({"regex": DATE, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be True or False"),
    ],
)
def test_bad_structured_outputs_params_name_the_problem(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json is not valid JSON"),
        (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json cannot be compiled"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex cannot be compiled"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar cannot be compiled"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_when_added_and_others_go_on(make_engine, so, match):
    eng = make_engine()
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", "ROMEO:", params(so))
    assert not eng.has_unfinished_requests()
    eng.add_request("good", "ROMEO:", params(StructuredOutputsParams(choice=CHOICES)))
    done = run_all(eng)
    assert eng.tokenizer.decode(done["good"]).strip("\n") in CHOICES or done["good"]


# ---- the bitmask ------------------------------------------------------------------------------------------


def test_a_bitmask_word_allows_the_tokens_of_its_set_bits():
    mask = torch.tensor([[0b0110, -1]], dtype=torch.int32)  # word 0: tokens 1, 2; word 1: tokens 32..63
    allowed = unpack_bitmask(mask, 40)[0]
    assert allowed.nonzero().flatten().tolist() == [1, 2, *range(32, 40)]
    logits = torch.zeros(1, 40)
    apply_token_bitmask_reference(logits, mask)
    assert torch.isinf(logits[0, 0]) and logits[0, 1] == 0 and torch.isinf(logits[0, 3]) and logits[0, 39] == 0


@pytest.mark.parametrize("vocab", [40, 4096, 49152 + 7])
def test_the_bitmask_kernel_equals_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    mask[::2, ::3] = -1  # whole words allowed (the kernel skips them)
    mask[1] = 0  # nothing allowed
    logits = torch.randn(9, vocab, generator=g)
    rows = [7, 0, 3, 8, 2, 5]
    want = logits.clone()
    want[rows] = apply_token_bitmask_reference(logits[rows].clone(), mask)
    got = logits.clone()
    apply_token_bitmask(got, mask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4, 6]], logits[[1, 4, 6]])  # rows without a mask are untouched


@pytest.mark.cuda
def test_the_bitmask_on_cuda_equals_the_reference():
    """xgrammar's CUDA kernel (scripts/gpu_check.sh runs this; without xgrammar there it is skipped)."""
    pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, 1536), dtype=torch.int32, generator=g)
    logits = torch.randn(8, 49152, generator=g)
    rows = [6, 1, 0, 4, 7]
    want = logits.clone()
    want[rows] = apply_token_bitmask_reference(logits[rows].clone(), mask)
    got = logits.cuda()
    apply_token_bitmask(got, mask, rows)
    assert torch.equal(got.cpu(), want)


# ---- outputs follow their constraints --------------------------------------------------------------------


def test_every_constraint_is_followed_greedy_and_sampled_on_both_bundled_models(gpt2, llama, reference):
    for llm in (gpt2, llama):
        every_case(llm, temperature=1.0)
    every_case(llama)
    assert ids(every_case(gpt2)) == reference  # greedy is deterministic


def test_constrained_rows_do_not_change_the_unconstrained_ones_and_batched_equals_alone(gpt2, reference):
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.token_ids for o in gpt2.generate(PROMPTS, plain, use_tqdm=False)]
    todo = [(so, p) for so in cases() for p in PROMPTS[:2]]
    mixed = gpt2.generate(PROMPTS + [p for _, p in todo], [plain] * len(PROMPTS) + [params(so) for so, _ in todo],
                          use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in mixed[: len(PROMPTS)]] == alone
    assert ids(mixed[len(PROMPTS) :]) == reference
    one = gpt2.generate([todo[0][1]], params(todo[0][0]), use_tqdm=False)
    assert ids(one) == reference[:1]


def test_a_step_without_constrained_rows_has_no_bitmask(make_engine):
    eng = make_engine()
    eng.add_request("plain", "ROMEO:", SamplingParams(temperature=0, max_tokens=30))
    eng.add_request("json", "ROMEO:", params(cases()[0], max_tokens=30))
    for _ in range(200):  # the schema compiles in a thread: "plain" runs meanwhile
        scheduler_output, _ = core(eng).step()
        if "json" in scheduler_output.num_scheduled_tokens:
            break
        assert scheduler_output.grammar_bitmask is None
        time.sleep(0.01)
    assert list(scheduler_output.structured_output_request_ids) == ["json"]
    words = (core(eng).config.model_config.vocab_size + 31) // 32
    assert scheduler_output.grammar_bitmask.shape == (1, words) and scheduler_output.grammar_bitmask.dtype == "int32"
    eng.abort_request("json")
    scheduler_output, _ = core(eng).step()
    assert scheduler_output.grammar_bitmask is None and not scheduler_output.structured_output_request_ids
    eng.abort_request("plain")


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # prompts in chunks
        {"enable_prefix_caching": True},
        {"async_scheduling": True},
        {"num_blocks": 24, "block_size": 4, "max_num_seqs": 8},  # preemption by recompute
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
        {
            "speculative_config": {
                "method": "draft_model",
                "model": "roseinfer/models/tiny-shakespeare-draft",
                "num_speculative_tokens": 3,
            }
        },  # fmt: skip
    ],
    ids=["chunked", "prefix-cache", "async", "preemption", "ngram", "draft-model"],
)
def test_every_path_gives_the_plain_engines_greedy_ids(kw, reference):
    with LLM(device="cpu", dtype="float32", **kw) as llm:
        assert ids(every_case(llm)) == reference
        every_case(llm, temperature=1.0)
        if "enable_prefix_caching" in kw:  # again, from the cache
            assert ids(every_case(llm)) == reference
        if kw.get("num_blocks") == 24:
            assert core(llm).scheduler.num_preemptions > 0


def test_n_completions_each_follow_the_constraint_from_their_own_matcher(gpt2):
    outs = every_case(gpt2, temperature=1.0, n=3)
    assert all(len(o.outputs) == 3 for o in outs)
    assert any(len({c.text for c in o.outputs}) > 1 for o in outs)  # sampled apart, each valid


def test_tensor_parallel_follows_the_constraints(reference):
    with LLM(device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        assert ids(every_case(llm)) == reference


def test_a_grammar_that_ends_finishes_the_request_even_with_ignore_eos(gpt2):
    out = gpt2.generate(["ROMEO:"], params(StructuredOutputsParams(choice=CHOICES), ignore_eos=True, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.text in CHOICES


# ---- compiling off the step loop -----------------------------------------------------------------------------


def add_compiling_to(eng, request_id: str, compiled: Future) -> None:
    """Add a date-regex request whose grammar is `compiled` (a Future the test finishes or fails)."""
    backend = core(eng).structured_output_manager.backend
    compile_async = backend.compile_async
    backend.compile_async = lambda key: compiled
    try:
        eng.add_request(request_id, "ROMEO:", params(StructuredOutputsParams(regex=DATE)))
    finally:
        backend.compile_async = compile_async


def test_a_request_waits_for_its_grammar_while_the_others_run(make_engine):
    eng = make_engine()
    backend_core = core(eng)
    eng.add_request("warm", "ROMEO:", params(StructuredOutputsParams(choice=CHOICES)))  # the backend exists now
    run_all(eng)
    backend = backend_core.structured_output_manager.backend
    pending: Future = Future()
    add_compiling_to(eng, "slow", pending)  # a compile that takes a while
    eng.add_request("plain", "JULIET:", SamplingParams(temperature=0, max_tokens=4))
    done = {}
    for _ in range(6):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert "plain" in done and "slow" not in done
    assert [r.request_id for r in backend_core.scheduler.waiting] == ["slow"]
    pending.set_result(backend._compile("regex", DATE))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    check(StructuredOutputsParams(regex=DATE), done["slow"].outputs[0].text, done["slow"].outputs[0].finish_reason)


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(make_engine):
    eng = make_engine()
    eng.add_request("warm", "ROMEO:", params(StructuredOutputsParams(choice=CHOICES)))
    run_all(eng)
    broken: Future = Future()
    broken.set_exception(RuntimeError("out of memory while compiling"))
    add_compiling_to(eng, "broken", broken)
    eng.add_request("plain", "JULIET:", SamplingParams(temperature=0, max_tokens=4))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["broken"].outputs[0].finish_reason == "error"
    assert done["plain"].outputs[0].finish_reason == "length"


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(make_engine):
    eng = make_engine()
    eng.add_request("a", "ROMEO:", params(StructuredOutputsParams(regex=DATE)))
    eng.add_request("b", "JULIET:", params(StructuredOutputsParams(regex=DATE)))
    manager = core(eng).structured_output_manager
    sa, sb = (core(eng).scheduler.requests[r].structured_output_request for r in "ab")
    assert sa.compiled is sb.compiled  # one compile for both
    run_all(eng)
    backend = manager.backend
    backend.cache_size = 2
    for i in range(4):
        backend.compile_async(("regex", f"x{i}"))
    assert len(backend.cache) == 2 and ("regex", "x3") in backend.cache
