"""Stage 02: KV cache == naive == HF; sampling filters; streaming detokenizer; stop conditions."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PROMPTS, core, greedy_ids, hf_greedy, make_random_checkpoint, run_python
from test_01_naive_decode import dense_greedy_tokens, eos_always_checkpoint

from roseinfer import LLM, RequestOutputKind, SamplingParams
from roseinfer.engine.detokenizer import Detokenizer
from roseinfer.model_executor.loader import load_model, read_model_config
from roseinfer.sample.sampler import SamplingTensors, sample
from roseinfer.worker.input_batch import InputBatch


def test_kv_cache_greedy_equals_naive_equals_hf(llm, tokenizer, hf_model):
    """The engine decodes through its paged KV cache; its greedy tokens are the naive dense loop's and HF's."""
    model = core(llm.llm_engine).model_runner.model
    for prompt in PROMPTS[:5]:
        ids = tokenizer.encode(prompt)
        cached = greedy_ids(llm, prompt, 64)
        assert dense_greedy_tokens(model, ids, cached) == cached, prompt
        assert cached == hf_greedy(hf_model, ids, 64), prompt


def test_prefill_and_decode_logits_equal_full_forward(llm, tokenizer):
    """Cached decoding must give the logits of a full forward. (Stage 07: through the paged cache;
    stage 09: each step is one flattened `forward_paged`, and a prompt may arrive in chunks.)"""
    from roseinfer.attention import TORCH_BACKEND, AttentionMetadata
    from roseinfer.core.kv_cache_manager import KVCacheManager
    from roseinfer.worker.kv_cache import KVCache

    model = core(llm.llm_engine).model_runner.model
    ids = tokenizer.encode(PROMPTS[1])
    T = len(ids)
    bm = KVCacheManager(block_size=8, num_blocks=16)
    pool = KVCache(model.config, 16, 8, torch.float32, torch.device("cpu")).layers

    def feed(start: int, n: int) -> torch.Tensor:
        """Tokens start .. start+n-1 as one step; returns their logits [n, V]."""
        assert bm.allocate_slots("s", n)
        pos, L = list(range(start, start + n)), start + n
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([bm.slot("s", p) for p in pos]),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([L], dtype=torch.int32),
            block_tables=torch.tensor([bm.get_block_table("s")], dtype=torch.int32),
            num_decodes=int(n == 1), max_query_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[L],
            backend=TORCH_BACKEND,
        )  # fmt: skip
        return model.compute_logits(model.forward_paged(torch.tensor(ids[start:L]), torch.tensor(pos), pool, meta))

    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]  # [T, V]
        assert torch.allclose(feed(0, T - 8), full[: T - 8], atol=1e-4)  # a first chunk
        assert torch.allclose(feed(T - 8, 3), full[T - 8 : T - 5], atol=1e-4)  # a chunk with context before it
        for t in range(T - 5, T):  # then one token at a time
            assert torch.allclose(feed(t, 1), full[t : t + 1], atol=1e-4), t


def test_kv_cache_on_a_random_checkpoint_matches_naive(tmp_path):
    d = make_random_checkpoint(tmp_path / "m", seed=5, n_positions=48)
    llm = LLM(d, device="cpu", num_blocks=16)
    a = llm.generate([7, 8, 9], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].token_ids
    model = load_model(d, read_model_config(d), torch.device("cpu"), torch.float32)
    assert dense_greedy_tokens(model, [7, 8, 9], a) == a and len(a) == 40


# ---- sampling -------------------------------------------------------------------------
def sampling_tensors(params: list[SamplingParams], V: int, generators=None) -> SamplingTensors:
    """The sampler's columns for one row per params, gathered as the model runner does (its input batch);
    row i draws from `generators[i]` (default: params[i]'s own, if seeded)."""
    ib = InputBatch(max_model_len=1, max_blocks_per_req=1, block_size=1, vocab_size=V, device=torch.device("cpu"),
                    capacity=len(params))  # fmt: skip
    gens = generators or [p.make_generator() for p in params]
    for i, (p, g) in enumerate(zip(params, gens, strict=True)):
        ib.add_request(str(i), [0], p, [0], 0, g)
    return ib.sampling_tensors(ib.rows([str(i) for i in range(len(params))]), torch.device("cpu"))


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> set[int]:
    """Sample n times (as one batch of n rows with their own generators)."""
    gens = [SamplingParams(seed=i).make_generator() for i in range(n)]
    out = sample(logits.expand(n, -1), sampling_tensors([params] * n, logits.shape[-1], gens))
    return set(out.tolist())


def test_top_k_never_samples_outside_the_k_largest():
    g = torch.Generator().manual_seed(0)
    for k in (1, 3, 10):
        logits = torch.randn(1, 100, generator=g)
        allowed = set(logits[0].topk(k).indices.tolist())
        got = _draw(logits, SamplingParams(temperature=2.0, top_k=k), 400)
        assert got <= allowed
        assert len(got) == k  # with 400 draws at temperature 2 every allowed token shows up


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()[None]
    assert _draw(logits, SamplingParams(top_p=0.5), 300) == {1}
    assert _draw(logits, SamplingParams(top_p=0.79), 300) == {1, 3}
    assert _draw(logits, SamplingParams(top_p=0.81), 300) == {1, 3, 2}
    assert _draw(logits, SamplingParams(top_p=1.0), 600) == {0, 1, 2, 3}
    assert _draw(logits, SamplingParams(top_p=0.9, top_k=1), 100) == {1}


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    n = 3000
    gens = [SamplingParams(seed=i).make_generator() for i in range(n)]
    out = sample(probs.log().expand(n, -1), sampling_tensors([SamplingParams()] * n, 3, gens))
    freq = torch.bincount(out, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0)] * 4
    assert sample(logits, sampling_tensors(greedy, 50)).tolist() == logits.argmax(-1).tolist()
    # greedy rows in a batch with sampling rows still take the argmax
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=3)] * 2
    got = sample(logits, sampling_tensors(mixed, 50)).tolist()
    assert got[0::2] == logits[0::2].argmax(-1).tolist()


def test_same_seed_same_text_different_seed_different_text(llm):
    def text(seed):
        p = SamplingParams(max_tokens=40, temperature=1.5, seed=seed)
        return llm.generate("Romeo.\n", p, use_tqdm=False)[0].text

    a = text(11)
    assert a == text(11)
    assert a != text(12)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -1),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("seed", "abc"),
        ("stop", [""]),
        ("stop", [3]),
        ("stop", 3),
        ("stop_token_ids", 7),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_sampling_params_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- streaming detokenizer ---------------------------------------------------------------
def test_stream_concat_equals_full_decode_on_random_tokens(tokenizer):
    tok = tokenizer
    rng = random.Random(0)
    emoji_ids = tok.encode("🌹🎭 naïve — 你好")
    for trial in range(50):
        ids = [rng.randrange(tok.vocab_size - 1) for _ in range(rng.randint(1, 40))]
        pos = rng.randint(0, len(ids))
        ids[pos:pos] = emoji_ids  # make sure multi-byte characters get split across tokens
        detok = Detokenizer(tok.token_bytes_table)
        text = "".join(detok.step(t) for t in ids) + detok.flush()
        assert text == tok.decode(ids), trial


def test_stream_never_emits_a_broken_character(tokenizer):
    tok = tokenizer
    ids = tok.encode("a rose 🌹 by any other name 🎭")
    detok = Detokenizer(tok.token_bytes_table)
    deltas = [detok.step(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "a rose 🌹 by any other name 🎭"
    assert "" in deltas  # some tokens completed no character yet


def test_detokenizer_stop_string_split_across_tokens(tokenizer):
    tok = tokenizer
    text = "Enter the King.\nExit the Queen."
    for stop in ["Exit", "King.\nEx", "\n"]:
        detok = Detokenizer(tok.token_bytes_table, stop=[stop])
        out = ""
        for t in tok.encode(text):
            out += detok.step(t)
            if detok.stopped:
                break
        out += detok.flush()
        assert detok.stopped and out == text[: text.index(stop)]


def test_engine_stop_strings_and_stop_token_ids(llm, tokenizer):
    greedy = SamplingParams(temperature=0, max_tokens=60)
    full = llm.generate("Hamlet.\n", greedy, use_tqdm=False)[0].text
    assert "\n" in full
    cut = llm.generate("Hamlet.\n", SamplingParams(temperature=0, max_tokens=60, stop=["\n"]), use_tqdm=False)[0]
    assert cut.text == full[: full.index("\n")] and cut.finish_reason == "stop"
    ids = greedy_ids(llm, "Hamlet.\n", 60)
    stopped = greedy_ids(llm, tokenizer.encode("Hamlet.\n"), 60, stop_token_ids=[ids[5]])
    assert stopped == ids[: ids.index(ids[5]) + 1]


def test_stream_yields_several_deltas(llm):
    params = SamplingParams(temperature=0, max_tokens=30, output_kind=RequestOutputKind.DELTA)
    outs = list(llm.llm_engine.stream(["Romeo.\n"], params))
    deltas = [o.text for o in outs]
    assert len([d for d in deltas if d]) > 5
    assert all(o.delta == o.text for o in outs)  # DELTA: each output carries only the step's new text
    final = llm.generate("Romeo.\n", SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "".join(deltas) == final.text
    assert [t for o in outs for t in o.token_ids] == final.token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_ignore_eos_keeps_going(tmp_path):
    llm = LLM(eos_always_checkpoint(tmp_path / "m"), device="cpu", num_blocks=16)
    out = llm.generate([1, 2], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == [llm.tokenizer.eos_token_id] * 7 and out.finish_reason == "length"


def test_cli_streams_the_same_text_as_llm_generate(llm):
    """Same seed, same logits: the CLI's token-by-token stream is LLM.generate's text."""
    from roseinfer.entrypoints.generate import DEFAULT_PROMPT

    r = run_python("-m", "roseinfer.entrypoints.generate", "--max-new-tokens", "12", "--seed", "3", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    p = SamplingParams(temperature=0.8, top_k=40, max_tokens=12, seed=3)  # the CLI's defaults
    assert r.stdout == DEFAULT_PROMPT + llm.generate(DEFAULT_PROMPT, p, use_tqdm=False)[0].text
