"""Stage 19: the sampling features a server offers, in the engine: penalties, logit_bias, min_tokens, min_p,
logprobs and prompt_logprobs, include_stop_str_in_output; seeds that stay in range; requests that fail alone.

Hugging Face is the oracle wherever it has the feature (repetition_penalty, sequence_bias, min_new_tokens,
MinPLogitsWarper, output_logits, a forward for prompt log-probabilities); frequency and presence penalties,
which it lacks, are checked against their formula applied to its logits step by step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PROMPTS, core, make_llama_checkpoint, run_all

from roseinfer import LLM, Logprob, RequestOutputKind, SamplingParams
from roseinfer.engine.detokenizer import Detokenizer
from roseinfer.sample.sampler import filtered_probs
from roseinfer.sampling_params import derived_seed
from roseinfer.worker.input_batch import InputBatch

EOS = 4095  # the bundled model's <|endoftext|>
V = 4096
GREEDY = dict(temperature=0, max_tokens=20)
# a pool of 16 blocks of 4 tokens for 8 requests: they preempt each other; a budget of 24 tokens a step cuts the
# longer prompts into chunks; prefix caching is on by default
TIGHT = dict(block_size=4, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=24)


def ids_of(tokenizer, prompts):
    return [tokenizer.encode(p) for p in prompts]


@torch.no_grad()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, **kw):
    """HF greedy `generate` with extra arguments: (new token ids, the raw logits of each step [T, V])."""
    x = torch.tensor([prompt_ids])
    eos = kw.pop("eos_token_id", model.config.eos_token_id)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=model.config.eos_token_id, eos_token_id=eos, output_logits=True,
                         return_dict_in_generate=True, **kw)  # fmt: skip
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.logits).float()


def greedy(llm, prompts, **params):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY | params), use_tqdm=False)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small random Llama (grouped-query attention) and its transformers twin."""
    path = tmp_path_factory.mktemp("llama")
    hf = make_llama_checkpoint(path, seed=3)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        yield llm, hf


def llama_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 383, (n,), generator=g).tolist() for n in (5, 17, 9)]


# ---- each feature against Hugging Face ----------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_hf_on_gpt2(llm, hf_model, tokenizer, penalty):
    prompts = ids_of(tokenizer, PROMPTS[:3])
    got = greedy(llm, prompts, repetition_penalty=penalty)
    assert got != greedy(llm, prompts)  # the penalty changes the text ...
    for p, g in zip(prompts, got, strict=True):  # ... exactly as HF's does
        assert g == hf_generate(hf_model, p, 20, repetition_penalty=penalty)[0]


def test_repetition_penalty_equals_hf_on_llama(llama):
    llm, hf = llama
    prompts = llama_prompts()
    got = greedy(llm, prompts, repetition_penalty=1.5, ignore_eos=True)
    assert got != greedy(llm, prompts, ignore_eos=True)
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_generate(hf, p, 20, repetition_penalty=1.5, eos_token_id=None)[0]


@torch.no_grad()
def penalised_reference(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's rule on HF's logits, step by step: logits[t] -= frequency·count[t] + presence·(count[t] > 0),
    counting generated tokens only."""
    out = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        out.append(int((logits - frequency * counts - presence * (counts > 0)).argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (-0.5, 0.7)])
def test_presence_and_frequency_penalties_follow_openais_rule(llm, hf_model, tokenizer, presence, frequency):
    prompts = ids_of(tokenizer, PROMPTS[:2])
    got = greedy(llm, prompts, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    assert got != greedy(llm, prompts, ignore_eos=True)
    for p, g in zip(prompts, got, strict=True):
        assert g == penalised_reference(hf_model, p, 20, presence, frequency)


def test_logit_bias_equals_hf_sequence_bias(llm, hf_model, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    plain = greedy(llm, [prompt])[0]
    banned, boosted = plain[1], tokenizer.encode(" Juliet")[0]
    bias = {banned: -100.0, str(boosted): 4.5}  # JSON keys are strings: "id" is the id
    (got,) = greedy(llm, [prompt], logit_bias=bias)
    assert got != plain and banned not in got
    ref, _ = hf_generate(hf_model, prompt, 20, sequence_bias=[[[banned], -100.0], [[boosted], 4.5]])
    assert got == ref


def test_min_tokens_equals_hf_min_new_tokens(llm, hf_model, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])
    eager_eos = {EOS: 30.0}  # EOS would win at every step
    assert greedy(llm, [prompt], logit_bias=eager_eos)[0] == [EOS]
    out = llm.generate([prompt], SamplingParams(**GREEDY, logit_bias=eager_eos, min_tokens=5), use_tqdm=False)[0]
    ref, _ = hf_generate(hf_model, prompt, 20, min_new_tokens=5, sequence_bias=[[[EOS], 30.0]])
    assert out.token_ids == ref and len(ref) == 6 and ref[-1] == EOS and out.finish_reason == "stop"
    # stop_token_ids are held back too (HF: a second EOS id)
    stop = tokenizer.encode(" the")[0]
    params = SamplingParams(**GREEDY, logit_bias={stop: 30.0}, min_tokens=3, stop_token_ids=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ref, _ = hf_generate(hf_model, prompt, 20, min_new_tokens=3, sequence_bias=[[[stop], 30.0]],
                         eos_token_id=[EOS, stop])  # fmt: skip
    assert out.token_ids == ref and len(ref) == 4 and ref[-1] == stop and out.finish_reason == "stop"


def sampling_tensors(params: list[SamplingParams], vocab: int):
    ib = InputBatch(max_model_len=8, max_blocks_per_req=1, block_size=8, vocab_size=vocab, device="cpu")
    for i, p in enumerate(params):
        ib.add_request(str(i), [0], p, [0], 0, p.make_generator())
    return ib, ib.sampling_tensors(ib.rows([str(i) for i in range(len(params))]), torch.device("cpu"))


def test_min_p_equals_hf_min_p_warper():
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    cases = [(0.7, 0.1), (1.0, 0.05), (1.5, 0.3), (1.0, 0.0)]
    _, t = sampling_tensors([SamplingParams(temperature=T, min_p=m) for T, m in cases], 300)
    got = filtered_probs(logits, t)
    for i, (T, m) in enumerate(cases):
        x = TemperatureLogitsWarper(T)(None, logits[i : i + 1].clone())
        ref = torch.softmax(MinPLogitsWarper(m)(None, x) if m else x, dim=-1)[0]
        assert torch.allclose(got[i], ref, atol=1e-6)
        assert (got[i] == 0).sum() == (ref == 0).sum() and ((ref == 0).sum() > 0) == (m > 0)


def test_min_p_one_keeps_only_the_top_token(llm, tokenizer):
    prompts = ids_of(tokenizer, PROMPTS[:3])
    sampled = SamplingParams(temperature=1.0, max_tokens=20, seed=1)
    assert [o.token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] != greedy(llm, prompts)
    only_top = dataclasses.replace(sampled, min_p=1.0)
    assert [o.token_ids for o in llm.generate(prompts, only_top, use_tqdm=False)] == greedy(llm, prompts)


def check_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], raw_logits: torch.Tensor, n: int, text):
    """Each position's dict: its token with the log-softmax of the raw logits and its true rank, then the top n."""
    assert len(entries) == len(tokens) == len(raw_logits)
    for d, tok, logits in zip(entries, tokens, raw_logits, strict=True):
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = lp.topk(n).indices.tolist()
        assert list(d)[0] == tok and set(d) == {tok, *top} and list(d)[1:] == [t for t in top if t != tok]
        assert abs(d[tok].logprob - lp[tok].item()) < 1e-4 and d[tok].rank == int((lp >= lp[tok]).sum())
        for r, t in enumerate(top, 1):
            assert abs(d[t].logprob - lp[t].item()) < 1e-4
            assert d[t].rank == (d[t].rank if t == tok else r) and d[t].decoded_token == text(t)


def test_logprobs_are_the_raw_log_softmax_of_hf_on_gpt2(llm, hf_model, tokenizer):
    """Raw: before the penalty, which changes the tokens but not their log-probabilities."""
    text = lambda t: tokenizer.token_bytes_table[t].decode("utf-8", errors="replace")  # noqa: E731
    prompts = ids_of(tokenizer, PROMPTS[:3])
    outs = llm.generate(prompts, SamplingParams(**GREEDY, logprobs=5, repetition_penalty=1.2), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        ref, raw = hf_generate(hf_model, prompt, 20, repetition_penalty=1.2)
        assert c.token_ids == ref
        check_logprobs(c.logprobs, ref, raw, 5, text)
        assert abs(c.cumulative_logprob - sum(d[t].logprob for d, t in zip(c.logprobs, ref, strict=True))) < 1e-4
    zero = llm.generate(prompts[:1], SamplingParams(**GREEDY, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert all(list(d) == [t] and d[t].rank == 1 for d, t in zip(zero.logprobs, zero.token_ids, strict=True))
    assert llm.generate(prompts[:1], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].logprobs is None


def test_logprobs_and_prompt_logprobs_on_llama(llama):
    llm, hf = llama
    prompts = llama_prompts()
    outs = llm.generate(prompts, SamplingParams(**GREEDY, ignore_eos=True, logprobs=3, prompt_logprobs=2),
                        use_tqdm=False)  # fmt: skip
    text = lambda t: llm.llm_engine.output_processor.token_text(t)  # noqa: E731
    for prompt, out in zip(prompts, outs, strict=True):
        ref, raw = hf_generate(hf, prompt, 20, eos_token_id=None)
        assert out.token_ids == ref
        check_logprobs(out.outputs[0].logprobs, ref, raw, 3, text)
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf, 2, text)


@torch.no_grad()
def check_prompt_logprobs(entries, prompt: list[int], model, n: int, text) -> None:
    """None first, then position j's dict: prompt token j scored by HF's logits at position j - 1."""
    logits = model(torch.tensor([prompt])).logits[0, :-1]  # [P - 1, V]
    assert entries[0] is None and len(entries) == len(prompt)
    check_logprobs(entries[1:], prompt[1:], logits, n, text)


def test_prompt_logprobs_through_chunks_and_past_the_prefix_cache(make_engine, hf_model, tokenizer):
    """A budget of 8 tokens cuts the prompt into chunks, each chunk's positions are gathered; a cached prefix
    is not used by a request that wants them (its positions must be computed), and is by one that does not."""
    text = lambda t: tokenizer.token_bytes_table[t].decode("utf-8", errors="replace")  # noqa: E731
    eng = make_engine(max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True)
    prompt = tokenizer.encode(PROMPTS[4])  # 25 tokens: 4 chunks
    eng.add_request("warm", prompt, SamplingParams(**GREEDY))
    run_all(eng)
    eng.add_request("lp", prompt, SamplingParams(**GREEDY, prompt_logprobs=3))
    eng.add_request("hit", prompt, SamplingParams(**GREEDY))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    lp, hit = outs["lp"][-1], outs["hit"][-1]
    assert lp.num_cached_tokens == 0 and hit.num_cached_tokens > 0
    check_prompt_logprobs(lp.prompt_logprobs, prompt, hf_model, 3, text)
    assert all(o.prompt_logprobs is lp.prompt_logprobs for o in outs["lp"])  # CUMULATIVE: in every output
    assert hit.prompt_logprobs is None and lp.token_ids == hit.token_ids
    one = core(eng).model_runner.input_batch
    assert one.num_prompt_logprob_rows == 0 and not one.prompt_logprobs_ready


def test_a_one_token_prompt_has_one_empty_prompt_logprob(llm):
    out = llm.generate([[11]], SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


# ---- stop strings and stop tokens -----------------------------------------------------------------------
def test_include_stop_str_in_output_and_the_text_of_stop_tokens(llm, make_engine, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    plain = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0]
    word = plain.text.strip().split()[0][1:4]  # a piece of the first word, after its first character
    cut = plain.text.index(word)
    stop_tok = plain.token_ids[2]
    stop_text = tokenizer.token_bytes_table[stop_tok].decode()
    before = tokenizer.decode(plain.token_ids[:2])
    cases = [  # (params, expected text, expected last token)
        (dict(stop=[word]), plain.text[:cut], None),
        (dict(stop=[word], include_stop_str_in_output=True), plain.text[: cut + len(word)], None),
        (dict(stop_token_ids=[stop_tok]), before, stop_tok),
        (dict(stop_token_ids=[stop_tok], include_stop_str_in_output=True), before + stop_text, stop_tok),
    ]
    eng = make_engine()
    for kind in RequestOutputKind:
        for i, (kw, _, _) in enumerate(cases):
            eng.add_request(str(i), prompt, SamplingParams(**GREEDY, output_kind=kind, **kw))
        text, tokens, reason = {}, {}, {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                c, rid = o.outputs[0], o.request_id
                if kind is RequestOutputKind.DELTA:  # the pieces add up
                    text[rid], tokens[rid] = text.get(rid, "") + c.text, tokens.get(rid, []) + c.token_ids
                else:
                    text[rid], tokens[rid] = c.text, c.token_ids
                reason[rid] = o.finish_reason
        for i, (_, want_text, last) in enumerate(cases):
            rid = str(i)
            assert text[rid] == want_text and reason[rid] == "stop", (kind, i)
            assert tokens[rid] == plain.token_ids[: len(tokens[rid])] and (last is None or tokens[rid][-1] == last)


def test_stop_strings_wait_for_min_tokens():
    table = [b"a", b"\n", b"bc", b"\n", b"d"]
    seq = [0, 1, 2, 3, 4]  # "a\nbc\nd"
    for min_tokens, text in [(0, "a"), (1, "a"), (2, "a\nbc"), (4, "a\nbc\nd")]:
        d = Detokenizer(table, stop=["\n"], min_tokens=min_tokens)
        for t in seq:
            d.step(t)
        d.flush()
        assert d.text == text and d.stopped == (len(text) < 6), min_tokens
    d = Detokenizer([b"x", b"AB", b"C", b"y"], stop=["ABC"], min_tokens=2)  # begins in token 2, ends in token 3
    for t in range(4):
        d.step(t)
    assert d.stopped and d.text == "x"


def test_min_tokens_in_the_engine_defers_stop_strings(llm, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    plain = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0]
    table = tokenizer.token_bytes_table
    for m in (0, 2, 4):
        start = len(b"".join(table[t] for t in plain.token_ids[:m]).decode())
        expected = plain.text[: plain.text.index("\n", max(0, start - len("\n") + 1))]
        out = llm.generate([prompt], SamplingParams(**GREEDY, stop=["\n"], min_tokens=m), use_tqdm=False)[0]
        assert out.text == expected and out.finish_reason == "stop", m


# ---- one batch, many features ---------------------------------------------------------------------------
MIXED = [
    SamplingParams(**GREEDY),
    SamplingParams(**GREEDY, repetition_penalty=1.4, logprobs=2),
    SamplingParams(**GREEDY, presence_penalty=1.0, frequency_penalty=0.6, prompt_logprobs=1),
    SamplingParams(**GREEDY, logit_bias={EOS: 20.0}, min_tokens=6),
    SamplingParams(temperature=0.9, max_tokens=20, seed=7, min_p=0.05, top_k=40, repetition_penalty=1.1),
    SamplingParams(temperature=1.0, max_tokens=20, seed=3, n=2, frequency_penalty=0.8, logprobs=1),
    SamplingParams(**GREEDY, logit_bias={"198": -100}, logprobs=0, prompt_logprobs=0),
    SamplingParams(temperature=0.7, max_tokens=20, seed=11),
]


def summary(out):
    """Everything a request's final output says (compare with `same`)."""
    r = lambda d: None if d is None else [(t, x.logprob, x.rank, x.decoded_token) for t, x in d.items()]  # noqa: E731
    comps = [(c.token_ids, c.text, c.finish_reason, c.logprobs and [r(d) for d in c.logprobs]) for c in out.outputs]
    return comps, out.prompt_logprobs and [r(d) for d in out.prompt_logprobs]


def same(a, b) -> bool:
    """Equal, floats (log-probabilities) within 1e-4: other rows in a batch, or a split over ranks, move them ~1e-6."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def alone(llm, prompts, params) -> list:
    """Each request alone, on a roomy engine: its `summary`."""
    return [summary(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params, strict=True)]


@pytest.fixture(scope="module")
def mixed_alone(llm):
    return alone(llm, PROMPTS, MIXED)


@pytest.mark.parametrize("kw", [
    TIGHT | {"preemption_mode": "recompute"}, TIGHT | {"preemption_mode": "swap", "swap_space": 0.01},
    {"async_scheduling": True}, TIGHT | {"tensor_parallel_size": 2},
], ids=["recompute", "swap", "async", "tp2"])  # fmt: skip
def test_batched_equals_unbatched_with_mixed_features_under_pressure(mixed_alone, kw):
    """All in one batch, in a pool that preempts, chunks and shares prefixes (or with async scheduling, or split
    over two tensor-parallel ranks, of which only the first samples): every request's tokens, text and
    log-probabilities are what it gets alone."""
    with LLM(device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
        assert same([summary(o) for o in outs], mixed_alone)
        if "preemption_mode" in kw:
            stats = llm.llm_engine.get_stats()
            assert stats["num_preemptions"] > 0 and (stats["num_swapped_out"] > 0) == (kw["preemption_mode"] == "swap")
        llm.llm_engine.step()  # the rows of the last finished requests go with the next step
        ib = core(llm.llm_engine).model_runner.input_batch
        assert not ib.requests and ib.output_counts is None and ib.num_processor_rows == ib.num_penalty_rows == 0


def test_llm_chat_passes_the_features_through(llm, tokenizer):
    conv = [{"role": "user", "content": "Romeo."}]
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    params = SamplingParams(**GREEDY, repetition_penalty=1.3, logprobs=2, prompt_logprobs=1, logit_bias={198: -5})
    chat = llm.chat(conv, params, use_tqdm=False, chat_template=template)[0]
    assert chat.prompt == "Romeo.\n"
    assert same(summary(chat), summary(llm.generate([tokenizer.encode("Romeo.\n")], params, use_tqdm=False)[0]))
    assert chat.outputs[0].logprobs and chat.prompt_logprobs[0] is None


def test_n_completions_copy_the_penalty_state(llm, tokenizer):
    prompts = ids_of(tokenizer, PROMPTS[:2])
    params = SamplingParams(**GREEDY, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=1)
    alone = [summary(o)[0][0] for o in llm.generate(prompts, params, use_tqdm=False)]
    outs = llm.generate(prompts, dataclasses.replace(params, n=3), use_tqdm=False)
    assert same([[summary(o)[0][i] for i in range(3)] for o in outs], [[a] * 3 for a in alone])


def test_speculative_decoding_leaves_requests_with_processors_undrafted(llm, make_engine, tokenizer):
    prompts = ids_of(tokenizer, PROMPTS[:3])
    params = [SamplingParams(**GREEDY), SamplingParams(**GREEDY, repetition_penalty=1.3),
              SamplingParams(**GREEDY, logprobs=2)]  # fmt: skip
    want = [summary(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params, strict=True)]
    eng = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    eng.trace = []
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(str(i), p, dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert same([summary(outs[str(i)]) for i in range(3)], want)
    drafted = {rid for step in eng.trace for rid in step["scheduled_spec_decode_tokens"]}
    assert drafted == {"0"}


# ---- streams -------------------------------------------------------------------------------------------
def test_delta_and_cumulative_streams_carry_logprobs(make_engine, tokenizer):
    prompt = tokenizer.encode(PROMPTS[3])
    eng = make_engine()
    base = SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=1, stop=["\n\n"])
    for kind in RequestOutputKind:
        eng.add_request(kind.name, prompt, dataclasses.replace(base, output_kind=kind))
    seen = {k.name: [] for k in RequestOutputKind}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append((o, len(o.token_ids) if o.request_id == "CUMULATIVE" else None))
    (final,) = [o for o, _ in seen["FINAL_ONLY"]]
    c = final.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) > 0
    delta = seen["DELTA"]
    assert [o.prompt_logprobs is not None for o, _ in delta] == [True] + [False] * (len(delta) - 1)
    assert delta[0][0].prompt_logprobs == final.prompt_logprobs
    assert sum((o.outputs[0].logprobs for o, _ in delta if o.outputs), []) == c.logprobs
    cum = seen["CUMULATIVE"]  # read after the stream ended: each still shows its own step's tokens
    for o, n in cum:
        assert len(o.outputs[0].logprobs) == n and o.outputs[0].logprobs == c.logprobs[:n]
        assert o.prompt_logprobs == final.prompt_logprobs
    assert cum[-1][0].outputs[0].cumulative_logprob == pytest.approx(c.cumulative_logprob)


# ---- checks, seeds, failures -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "msg"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"logit_bias": {-1: 1}}, "logit_bias keys"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens .17. must not exceed max_tokens .16."), ({"min_p": 1.5}, "min_p"),
    ({"logprobs": 21}, r"logprobs must be None or an int in \[0, 20\]"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 2.0}, "prompt_logprobs"), ({"include_stop_str_in_output": 1}, "include_stop_str"),
])  # fmt: skip
def test_bad_values_are_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_ids_outside_the_vocabulary_fail_at_admission(make_engine):
    eng = make_engine()
    for kw, name in [({"logit_bias": {"4096": 1.0}}, "logit_bias"), ({"stop_token_ids": [7, 5000]}, "stop_token_ids")]:
        for check in (lambda p: eng.add_request("x", [1, 2], p), lambda p: eng.check_request([1, 2], p)):  # noqa: B023
            with pytest.raises(ValueError, match=rf"{name} has token ids \[\d+\] outside the vocabulary \[0, 4096\)"):
                check(SamplingParams(**kw))
    assert not eng.has_unfinished_requests()
    assert SamplingParams(logit_bias={"4095": -1}).logit_bias == {4095: -1.0}


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1, 2**64 - 1])
def test_every_derived_seed_is_in_range(seed):
    for index in (0, 1, 2, 1000, 10**6, 2**64):
        s = derived_seed(seed, index)
        assert 0 <= s < 2**64 and s == (seed + index) % 2**64
        torch.Generator().manual_seed(s)
    assert SamplingParams(seed=seed, n=1000).make_generator(index=999) is not None


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1])
def test_seeds_at_both_ends_run_n_completions(llm, seed):
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=seed, n=6)
    a = [c.token_ids for c in llm.generate(["Romeo."], params, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate(["Romeo."], params, use_tqdm=False)[0].outputs]
    assert a == b and len(a) == 6 and len({tuple(x) for x in a}) > 1


def test_features_cost_nothing_when_unused():
    ib, t = sampling_tensors([SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9)], V)
    assert t.processors is None and ib.output_counts is None and ib.num_logprob_rows == 0
    ib.add_request("pen", [1, 2, 3], SamplingParams(presence_penalty=0.5), [0], 0, None)
    counts = ib.output_counts
    assert counts is not None and counts.shape == (ib.capacity, V) and ib.prompt_mask[ib.req_id_to_row["pen"], 2]
    assert ib.sampling_tensors(ib.rows(["0", "1"]), torch.device("cpu")).processors is None  # not in this step
    procs = ib.sampling_tensors(ib.rows(["0", "pen"]), torch.device("cpu")).processors
    assert procs.penalty_rows.tolist() == [1] and procs.bias_index is None and procs.min_p is None
    ib.remove_request("pen")
    assert ib.output_counts is None and ib.prompt_mask is None and ib.num_processor_rows == 0


def test_a_row_forgets_its_last_request():
    """A row given back and taken again carries nothing of its previous request (min_p is read for every row of a
    step in which any row uses it)."""
    ib, _ = sampling_tensors([SamplingParams(min_p=0.5, min_tokens=3, logit_bias={1: 2.0}, temperature=1.0)], V)
    row = ib.req_id_to_row["0"]
    ib.remove_request("0")
    ib.add_request("plain", [1], SamplingParams(temperature=1.0), [0], 0, None)
    ib.add_request("min_p", [1], SamplingParams(temperature=1.0, min_p=0.2), [0], 0, None)
    assert ib.req_id_to_row["plain"] == row
    procs = ib.sampling_tensors(ib.rows(["plain", "min_p"]), torch.device("cpu")).processors
    assert procs.min_p.tolist() == pytest.approx([0.0, 0.2]) and procs.bias_index is None and procs.masked is None
