"""Stage 14: speculative decoding. Draft (n-gram lookup or a draft model), verify in one forward, lose nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import DEFAULT_MODEL, PROMPTS, core, hf_greedy, make_random_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer import LLM, BeamSearchParams, LLMEngine, SamplingParams
from roseinfer.config import SpeculativeConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.sched.output import ModelRunnerOutput
from roseinfer.sample import rejection_sampler as rs
from roseinfer.sample.sampler import SamplingTensors, filtered_probs, sample
from roseinfer.spec_decode import speculating_rows
from roseinfer.spec_decode.draft_model import DraftModelProposer
from roseinfer.spec_decode.ngram import NgramProposer
from roseinfer.worker.input_batch import InputBatch

DRAFT = str(Path(DEFAULT_MODEL).parent / "tiny-shakespeare-draft")  # the bundled draft model
REPEAT = "ROMEO.\nI will go, I will go.\nJULIET.\nStay, stay.\nROMEO.\nI will go, I will go.\nJULIET.\n"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


def draft(k: int, model: str = DRAFT) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def make(spec: dict | None = None, **kw) -> LLM:
    return LLM(device="cpu", dtype="float32", speculative_config=spec, **{"num_blocks": 256, **kw})


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_leak(llm: LLM) -> None:
    """No KV block held; after one more (empty) step the runner and the draft model forget every request."""
    eng = llm.llm_engine
    kv = core(eng).kv_cache_manager
    assert kv.num_used_blocks == 0 and not kv.block_tables and not eng.has_unfinished_requests()
    assert eng.step() == []  # the runner learns which requests finished with the next step
    assert not core(eng).model_runner.input_batch.requests
    proposer = core(eng).model_runner.proposer
    if isinstance(proposer, DraftModelProposer):  # its K/V bookkeeping per request
        assert not proposer.computed and not proposer.fed


def columns(params: list[SamplingParams], vocab_size: int, generators: dict | None = None) -> SamplingTensors:
    """The sampler's per-row parameters for one row per SamplingParams (top_k = V when off)."""
    top_k = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
    greedy = all(p.greedy for p in params)
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        all_greedy=greedy,
        needs_filter=not greedy and any(k < vocab_size or p.top_p < 1 for k, p in zip(top_k, params, strict=True)),
        generators=generators or {},
    )


@pytest.fixture(scope="module")
def plain() -> LLM:
    return make()


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return token_ids(plain, [*PROMPTS, REPEAT], GREEDY)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A draft that knows nothing (random weights, the bundled vocabulary): most of its guesses are wrong."""
    return str(make_random_checkpoint(tmp_path_factory.mktemp("draft"), seed=3, n_positions=512, n_layer=1))


# ---- the config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, ValueError, "method must be one of"),
        ({"method": "ngram"}, ValueError, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2}, ValueError, "needs 'method'"),
        (ngram(0), ValueError, "num_speculative_tokens must be an int >= 1"),
        (ngram(True), ValueError, "num_speculative_tokens must be an int >= 1"),
        (ngram(2, prompt_lookup_min=4, prompt_lookup_max=2), ValueError, "prompt_lookup_min \\(4\\) must be <="),
        (ngram(2, prompt_lookup_min=0), ValueError, "prompt_lookup_min must be an int >= 1"),
        (ngram(2, draft_tokens=3), ValueError, "unknown keys \\['draft_tokens'\\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs 'model'"),
        ("ngram", TypeError, "must be a dict"),
    ],
)
def test_bad_speculative_config_is_a_clear_error(config, error, match):
    with pytest.raises(error, match=match):
        make(config)


def test_ngram_lookup_defaults_and_a_draft_that_does_not_fit_the_target(tmp_path):
    c = SpeculativeConfig.from_dict(ngram(3))
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 5)
    c = SpeculativeConfig.from_dict(ngram(3, prompt_lookup_min=7))
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    other_vocab = make_random_checkpoint(tmp_path / "v", vocab_size=512, n_positions=512, tokenizer=False)
    with pytest.raises(ValueError, match="vocabulary \\(512 tokens\\) differs from the target's \\(4096\\)"):
        make(draft(2, str(other_vocab)))
    short = make_random_checkpoint(tmp_path / "s", n_positions=64)
    with pytest.raises(ValueError, match="context \\(64\\) is shorter than the target's \\(512\\)"):
        make(draft(2, str(short)))


# ---- the pieces ----------------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_match():
    p = NgramProposer(k=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #                 0  1  2  3  4  5  6  7  8  9
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 8, 2, 3], 3) == [8, 2, 3]  # "2 3" last seen at 5..6, then 8
    assert p.lookup([5, 1, 2, 3, 4, 7, 2, 3, 6, 1, 2, 3], 2) == [4, 7]  # "1 2 3" (n=3) beats the later "2 3"
    assert p.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert p.lookup([4, 4], 3) == [4]  # only what exists after the match
    assert NgramProposer(k=3, prompt_lookup_min=2, prompt_lookup_max=3).lookup([7, 1, 5, 1], 3) == []  # n >= 2
    assert p.lookup(np.array([1, 2, 3, 9, 1, 2, 3, 8, 2, 3]), 3) == [8, 2, 3]  # the runner's token row, in place


def test_drafts_never_run_past_max_tokens_or_the_context():
    """After a step has sampled, the rows that may speculate and how many drafts each is worth: a step yields
    up to drafts + 1 tokens, within max_tokens and the context; n > 1 and beams never speculate."""
    ib = InputBatch(max_model_len=512, max_blocks_per_req=40, block_size=16, vocab_size=4096, device="cpu")
    ib.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5), [0], 3, None)
    ib.add_request("b", list(range(509)), SamplingParams(max_tokens=100), list(range(1, 33)), 509, None)
    ib.add_request("n2", [1, 2, 3], SamplingParams(max_tokens=50, n=2), [33], 3, None)
    ib.add_request("beam", [1, 2, 3], BeamSearchParams(2, 50), [34], 3, None)
    for rid in ("a", "b", "n2"):
        ib.append_tokens(ib.req_id_to_row[rid], [7])  # the token this step sampled
    out = ModelRunnerOutput(req_ids=["a", "b", "n2", "beam"], sampled_token_ids=[[7], [7], [7], []])
    runner = SimpleNamespace(input_batch=ib)
    row = ib.req_id_to_row
    # a: 4 tokens to go: 3 drafts + the target's own token; b: 510 tokens, 2 more fill the 512-token context
    assert speculating_rows(runner, out, 8) == [("a", row["a"], 3), ("b", row["b"], 1)]
    assert speculating_rows(runner, out, 2) == [("a", row["a"], 2), ("b", row["b"], 1)]  # never more than k
    ib.append_tokens(row["a"], [7, 7, 7])
    assert speculating_rows(runner, out, 8) == [("b", row["b"], 1)]  # a: one token left: plain decoding


def test_trim_gives_back_the_blocks_of_rejected_drafts():
    bm = KVCacheManager(block_size=4, num_blocks=8)
    assert bm.allocate_slots("a", 6)
    assert bm.allocate_slots("a", 1 + 8)  # the last token + 8 drafts: 15 slots, 4 blocks
    assert len(bm.block_tables["a"]) == 4 and bm.num_free_blocks == 4
    bm.trim("a", 9)  # 2 drafts accepted
    assert len(bm.block_tables["a"]) == 3 and bm.num_tokens["a"] == 9 and bm.num_free_blocks == 5
    with pytest.raises(ValueError, match="holds 9"):
        bm.trim("a", 10)
    # a draft model's lookahead: slots booked past the tokens for its guesses, not counted as tokens
    assert bm.allocate_slots("a", 3, lookahead=4)  # 12 tokens + 4 ahead: 16 slots, 4 blocks
    assert len(bm.block_tables["a"]) == 4 and bm.num_tokens["a"] == 12 and bm.num_free_blocks == 4
    bm.trim("a", 10, lookahead=4)  # 14 slots: the 4 blocks stay
    assert len(bm.block_tables["a"]) == 4 and bm.num_tokens["a"] == 10
    bm.trim("a", 10)  # no lookahead: 10 slots, 3 blocks
    assert len(bm.block_tables["a"]) == 3 and bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_greedy_verification_keeps_drafts_up_to_the_first_miss():
    logits = torch.full((4, 6), -5.0)
    logits[torch.arange(4), torch.tensor([2, 4, 1, 5])] = 5.0  # the target's argmax at each position
    greedy = columns([SamplingParams(temperature=0)], 6)
    assert rs.rejection_sample(logits, [[2, 4, 0]], [None], greedy) == [[2, 4, 1]]  # miss at 2: its own 1
    assert rs.rejection_sample(logits, [[2, 4, 1]], [None], greedy) == [[2, 4, 1, 5]]  # all pass: a bonus
    assert rs.rejection_sample(logits[:2], [[3]], [None], greedy) == [[2]]  # a miss at once: one token
    two = columns([SamplingParams(temperature=0)] * 2, 6)  # two requests in one call, 3 and 1 drafts
    assert rs.rejection_sample(torch.cat([logits, logits[:2]]), [[2, 4, 0], [2]], [None, None], two) == [
        [2, 4, 1],
        [2, 4],
    ]


@settings(max_examples=60, deadline=None)
@given(ks=st.lists(st.integers(1, 5), min_size=1, max_size=5), seed=st.integers(0, 2**16), data=st.data())
def test_a_verifying_batch_gives_each_request_what_it_would_get_alone(ks, seed, data):
    """Requests with different numbers of drafts verified in one call (padded to the longest): a greedy request
    keeps its drafts up to the first that is not the target's argmax, then gets the argmax there; a sampling one
    keeps a leading run of its drafts and one token more; a seeded one gets the same tokens as alone."""
    V = 6
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(k + 1 for k in ks), V, generator=g) * 3
    argmax = logits.argmax(dim=-1).tolist()
    starts = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]
    drafts = [  # each draft the target's argmax or not, so that misses come anywhere
        [argmax[s + j] if data.draw(st.booleans()) else data.draw(st.integers(0, V - 1)) for j in range(k)]
        for s, k in zip(starts, ks, strict=True)
    ]
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])), seed=i) for i in range(len(ks))]
    gens = {i: p.make_generator() for i, p in enumerate(params) if not p.greedy}
    out = rs.rejection_sample(logits, drafts, [None] * len(ks), columns(params, V, gens))
    for i, (s, k, d, p, tokens) in enumerate(zip(starts, ks, drafts, params, out, strict=True)):
        m = len(tokens) - 1
        assert 0 <= m <= k and tokens[:m] == d[:m]
        if p.greedy:
            want = next((j for j in range(k) if d[j] != argmax[s + j]), k)
            assert tokens == d[:want] + [argmax[s + want]]
        else:
            g_alone = p.make_generator()
            alone = rs.rejection_sample(logits[s : s + k + 1], [d], [None], columns([p], V, {0: g_alone}))
            assert tokens == alone[0]
            assert torch.equal(gens[i].get_state(), g_alone.get_state())  # and its stream moved on as far


def test_rejection_sampling_accepts_what_the_target_agrees_with():
    p_logits = torch.tensor([[0.0, 0.0, -1e9], [0.0, -1e9, 0.0]])  # p0 = (.5, .5, 0), p1 = (.5, 0, .5)
    t = columns([SamplingParams(temperature=1.0)], 3, {0: torch.Generator().manual_seed(0)})
    q_same = torch.softmax(p_logits[:1], dim=-1)
    for _ in range(50):  # q == p: never rejected, and the bonus comes from p1 (never token 1)
        out = rs.rejection_sample(p_logits, [[1]], [q_same], t)[0]
        assert out[0] == 1 and out[1] in (0, 2)
    for _ in range(50):  # a guess the target gives no mass: always rejected, replaced by a draw from p0
        assert rs.rejection_sample(p_logits, [[2]], [None], t)[0] in ([0], [1])


def test_rejection_sampling_turns_draws_from_q_into_draws_from_p():
    """One position: drafts drawn from q = (.8, .1, .1), target p = (.2, .3, .5). The first token out must be
    distributed as p, though 80% of the drafts are token 0 (4,000 seeded draws; 5 standard deviations)."""
    p_logits = torch.tensor([[0.2, 0.3, 0.5], [1.0, 1.0, 1.0]]).log()
    q = torch.tensor([[0.8, 0.1, 0.1]])
    g = torch.Generator().manual_seed(1)
    t = columns([SamplingParams(temperature=1.0)], 3, {0: g})
    first = torch.zeros(3)
    for _ in range(4000):
        d = int(torch.multinomial(q[0], 1, generator=g))
        first[rs.rejection_sample(p_logits, [[d]], [q], t)[0][0]] += 1
    p = torch.tensor([0.2, 0.3, 0.5])
    assert ((first / 4000 - p).abs() < 5 * (p * (1 - p) / 4000).sqrt()).all(), first


# ---- greedy: the same tokens as without speculation, and as Hugging Face ----------------------------------
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_batch_equals_plain_decoding(method, k, reference):
    llm = make(ngram(k) if method == "ngram" else draft(k))
    assert token_ids(llm, [*PROMPTS, REPEAT], GREEDY) == reference
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))  # position i needs 0 .. i-1
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def hf_alone(hf_model, tokenizer) -> dict[str, list[int]]:
    return {p: hf_greedy(hf_model, tokenizer.encode(p), GREEDY.max_tokens) for p in (REPEAT, PROMPTS[1])}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_alone_equals_hugging_face(method, k, hf_alone):
    llm = make(ngram(k) if method == "ngram" else draft(k))
    for prompt, want in hf_alone.items():
        assert token_ids(llm, [prompt], GREEDY)[0] == want
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("spec", "mode"),
    [(draft(4), None), ("random", None), (draft(8, DEFAULT_MODEL), None), (ngram(4), None), (draft(4), "swap")],
)
def test_greedy_under_preemption_chunked_prefill_and_prefix_caching(spec, mode, reference, random_draft):
    """A 10-block pool for 9 requests: they preempt each other; prompts arrive in 8-token chunks and the
    shared ones hit the prefix cache. Drafts: the bundled one, a random one (nearly always wrong), the target
    itself (always right: every step ends with a bonus token), n-gram lookup; and the bundled one with requests
    swapped out and back (its own K/V stay behind: it must compute them again)."""
    spec = draft(4, random_draft) if spec == "random" else spec
    llm = make(spec, num_blocks=10, block_size=8, max_num_batched_tokens=24, max_num_seqs=6, preemption_mode=mode)
    assert token_ids(llm, [*PROMPTS, REPEAT], GREEDY) == reference
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and (stats["num_swapped_out"] > 0) == (mode == "swap")
    assert_no_leak(llm)


def test_the_draft_model_keeps_its_kv_in_its_own_pool_at_the_targets_slots():
    """The draft has K/V tensors of its own but no block table: block b of its pool holds the same positions of a
    request as block b of the target's. After a few steps its pool holds, at the request's slots, the draft
    model's K/V (Hugging Face's, layer by layer) of every token and of the guesses it fed, in the slots the
    scheduler booked past the request's tokens."""
    from transformers import GPT2LMHeadModel

    k, bs = 4, 8
    eng = LLMEngine(device="cpu", dtype="float32", num_blocks=64, block_size=bs, speculative_config=draft(k))
    runner, proposer = core(eng).model_runner, core(eng).model_runner.proposer
    hf = GPT2LMHeadModel.from_pretrained(DRAFT, dtype=torch.float32).eval()
    C, H = hf.config.n_embd, hf.config.n_head
    assert isinstance(proposer, DraftModelProposer) and eng.config.scheduler_config.num_lookahead_tokens == k
    assert len(proposer.kv_cache.layers) == hf.config.n_layer != len(runner.kv_cache.layers)
    assert proposer.kv_cache.layers[0][0].shape == (runner.kv_cache.num_blocks, bs, H, C // H)
    eng.add_request("r", REPEAT, GREEDY)
    for _ in range(3):
        eng.step()
    req = core(eng).scheduler.requests["r"]
    fed = req.spec_token_ids[: k - 1]  # the next step's drafts: d1 .. d(k-1) went through the draft
    assert proposer.computed["r"] == req.num_tokens and proposer.fed["r"] == fed and len(req.spec_token_ids) == k
    tokens = req.all_token_ids + fed
    table = core(eng).kv_cache_manager.block_tables["r"]
    assert len(table) * bs >= len(tokens)  # the guesses' slots were booked in the request's own blocks
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(tokens))])
    with torch.no_grad():
        hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # the input of every block
        for block, (k_pool, v_pool), x in zip(hf.transformer.h, proposer.kv_cache.layers, hidden[:-1], strict=True):
            _, key, value = block.attn.c_attn(block.ln_1(x[0])).split(C, dim=-1)  # [T, C] each
            torch.testing.assert_close(k_pool.view(-1, H, C // H)[slots], key.view(len(tokens), H, -1))
            torch.testing.assert_close(v_pool.view(-1, H, C // H)[slots], value.view(len(tokens), H, -1))


def test_stop_strings_stop_token_ids_and_max_tokens_land_where_they_would(plain):
    spec = make(draft(8, DEFAULT_MODEL))  # every draft accepted: each step could run 9 tokens past a stop
    full = token_ids(plain, [REPEAT], GREEDY)[0]
    text = plain.generate([REPEAT], GREEDY, use_tqdm=False)[0].text
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 7, 10)] + [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full[5]]),
        SamplingParams(temperature=0, max_tokens=24, stop=[text[9:13]]),
        SamplingParams(temperature=0, max_tokens=24, stop=[text[20:22]], ignore_eos=True),
    ]
    for params in cases:
        a, b = (x.generate([REPEAT], params, use_tqdm=False)[0] for x in (plain, spec))
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
    assert_no_leak(spec)


def test_streamed_deltas_add_up_to_the_text(plain):
    engine = LLMEngine(device="cpu", dtype="float32", num_blocks=64, speculative_config=draft(8, DEFAULT_MODEL))
    engine.add_request("r", REPEAT, GREEDY)
    deltas, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        deltas += [o.delta for o in engine.step()]
    assert "".join(deltas) == plain.generate([REPEAT], GREEDY, use_tqdm=False)[0].text
    assert steps <= 4  # 1 prefill + 24 tokens at up to 9 a step


def test_n_greater_than_one_and_beam_search_still_work_with_speculation(plain):
    llm = make(ngram(4))
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=5, n=3)
    a, b = (x.generate([REPEAT], params, use_tqdm=False)[0] for x in (plain, llm))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # groups do not speculate
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    a, b = ([s.token_ids for s in x.beam_search([REPEAT], beams)[0].sequences] for x in (plain, llm))
    assert a == b
    assert_no_leak(llm)


def test_a_request_forked_next_to_a_speculating_one_samples_from_its_own_row(plain):
    """n = 2 forks in the same step as another request verifies drafts: the children read their parent's row,
    not a row of the drafts (which come before it in the step's logits)."""
    engine = LLMEngine(device="cpu", dtype="float32", num_blocks=64, speculative_config=draft(4, DEFAULT_MODEL))
    engine.add_request("a", REPEAT, GREEDY)
    engine.step(), engine.step()  # "a" is decoding with drafts from now on
    engine.add_request("b", "KING.", SamplingParams(temperature=0, max_tokens=6, n=2))
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    want = plain.generate(["KING."], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].token_ids
    assert done["b"] == [want, want]


def test_seeded_sampling_with_speculation_is_reproducible_and_alone_equals_batched():
    llm = make(draft(4))
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=s) for s in range(4)]
    batched = token_ids(llm, [REPEAT] * 4, params)
    assert batched == token_ids(llm, [REPEAT] * 4, params)
    assert [token_ids(llm, [REPEAT], p)[0] for p in params] == batched
    assert len({tuple(t) for t in batched}) > 1
    assert_no_leak(llm)


# ---- sampling: the same distribution as without speculation ------------------------------------------------
def exact_distribution(model_dir: Path, prompt: list[int], params: SamplingParams, steps: int) -> dict:
    """P(first `steps` tokens) under the target's filtered sampling distribution, by enumerating every path
    with Hugging Face's model (the reference, not ours)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    cols = columns([params], hf.config.vocab_size)
    paths = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for path, prob in paths.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(path)])).logits[0, -1:]
            p = filtered_probs(logits, cols)[0]
            for t in p.nonzero()[:, 0].tolist():
                nxt[path + (t,)] = prob * p[t].item()
        paths = nxt
    return paths


def chi_square_p_value(counts: dict, expected: dict, n: int) -> float:
    """Pearson's chi-square test of observed path counts against the exact probabilities. Paths expected fewer
    than 5 times are pooled into one cell (the test's usual rule); the p-value is the chi-square survival
    function, i.e. the regularised upper incomplete gamma function."""
    assert set(counts) <= set(expected), f"paths the target can never produce: {set(counts) - set(expected)}"
    rare = [path for path, p in expected.items() if n * p < 5]
    cells = [(counts.get(path, 0), n * p) for path, p in expected.items() if path not in rare]
    cells.append((sum(counts.get(path, 0) for path in rare), n * sum(expected[path] for path in rare)))
    stat = sum((seen - want) ** 2 / want for seen, want in cells if want > 0)
    dof = sum(want > 0 for _, want in cells) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()


N_DRAWS = 2400
ALPHA = 1e-3  # each test wrongly fails with probability 0.1% at most: fixed seeds make it pass or fail for good
TOP_K = SamplingParams(temperature=1.0, top_k=3)


def sampled_paths(llm: LLM, prompt: list[int], steps: int) -> dict:
    """How often each path of the first `steps` tokens comes out in N_DRAWS seeded requests. Each request asks
    for 2 more tokens than that, so that the tokens tested come from verified drafts, not only plain steps."""
    seeded = [SamplingParams(temperature=1.0, top_k=3, max_tokens=steps + 2, ignore_eos=True, seed=1000 + i)
              for i in range(N_DRAWS)]  # fmt: skip
    counts: dict = {}
    for ids in token_ids(llm, [prompt] * N_DRAWS, seeded):
        counts[tuple(ids[:steps])] = counts.get(tuple(ids[:steps]), 0) + 1
    return counts


def spec_llm(spec: dict) -> LLM:
    return make(spec, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def expected_paths(tokenizer) -> tuple[list[int], dict]:
    prompt = tokenizer.encode(REPEAT)
    return prompt, exact_distribution(Path(DEFAULT_MODEL), prompt, TOP_K, 3)


@pytest.mark.parametrize("spec", [draft(3), ngram(3)])
def test_sampled_output_has_the_target_distribution(spec, expected_paths):
    """Chi-square over the first 3 tokens (top_k=3: at most 27 paths) of 2,400 seeded draws, against the exact
    probabilities. The prompt repeats itself, so the n-gram proposer's guesses are often right."""
    prompt, expected = expected_paths
    llm = spec_llm(spec)
    p = chi_square_p_value(sampled_paths(llm, prompt, 3), expected, N_DRAWS)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # both paths ran
    assert p > ALPHA, f"speculative samples do not follow the target's distribution (p = {p:.2g})"


def test_the_chi_square_test_catches_a_sampler_that_accepts_every_draft(expected_paths, monkeypatch):
    """The same test on a broken verifier that keeps every draft: the draft's distribution leaks into the output,
    and the test rejects it."""

    def accept_all(logits, drafts, draft_probs, t):
        out, row = [], 0
        for s, d in enumerate(drafts):
            row += len(d) + 1
            one = SamplingTensors(t.temperature[s : s + 1], t.top_k[s : s + 1], t.top_p[s : s + 1], t.all_greedy,
                                  t.needs_filter, {0: t.generators[s]} if s in t.generators else {})  # fmt: skip
            out.append(list(d) + sample(logits[row - 1 : row], one).tolist())  # every draft, then a bonus from p
        return out

    monkeypatch.setattr("roseinfer.worker.model_runner.rejection_sample", accept_all)
    prompt, expected = expected_paths
    counts = sampled_paths(spec_llm(draft(3)), prompt, 3)
    possible = {path: n for path, n in counts.items() if path in expected}
    assert len(possible) < len(counts)  # it even produced paths the target can never produce (top_k=3)
    assert chi_square_p_value(possible, expected, N_DRAWS) < ALPHA  # and the others are off too


# ---- the server ------------------------------------------------------------------------------------------
def test_the_server_speculates_streams_the_same_text_and_exports_the_counters(plain):
    import httpx
    import openai
    from test_13_server import assert_engine_empty, running_server

    want = plain.generate([REPEAT], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].text
    with running_server(speculative_config=ngram(4)) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="roseinfer", prompt=REPEAT, max_tokens=30, temperature=0)
        assert r.choices[0].text == want
        stream = client.completions.create(model="roseinfer", prompt=REPEAT, max_tokens=30, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        metrics = httpx.get(url + "/metrics").text
        stats = engine.engine.get_stats()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            line = next(x for x in metrics.splitlines() if x.startswith(f"vllm:spec_decode_{name}_total"))
            assert float(line.split()[-1]) == stats[f"spec_decode_{name}"] > 0
        assert (
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="roseinfer",position="0"}'
            in metrics
        )
        assert_engine_empty(engine)


def test_roseinfer_serve_takes_a_speculative_config():
    from roseinfer.entrypoints.cli import main

    with pytest.raises(SystemExit):  # --help lists it
        main(["serve", "--help"])
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])


def test_spec_decode_example_runs():
    from conftest import run_python

    r = run_python("examples/spec_decode_example.py", "--max-tokens", "24", "--steps", "4")
    assert r.returncode == 0, r.stderr
    assert "same tokens" in r.stdout and "False" not in r.stdout
