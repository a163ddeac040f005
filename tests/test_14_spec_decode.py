"""Stage 14: speculative decoding. Draft (n-gram lookup or a draft model), verify in one forward, lose nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_MODEL, PROMPTS, hf_greedy, make_random_checkpoint

from roseinfer import LLM, LLMEngine, SamplingParams
from roseinfer.block_manager import BlockSpaceManager
from roseinfer.spec_decode import SpeculativeConfig, max_spec_tokens
from roseinfer.spec_decode import rejection_sampler as rs
from roseinfer.spec_decode.ngram import NgramProposer

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
    assert llm.block_manager.num_used_blocks == 0 and not llm.block_manager.block_tables
    proposer = llm.llm_engine.proposer
    if hasattr(proposer, "block_manager"):  # the draft model's own pool
        assert proposer.block_manager.num_used_blocks == 0 and not proposer.seqs


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


def test_drafts_never_run_past_max_tokens_or_the_context(engine):
    s = engine.new_session("a", [1, 2, 3], SamplingParams(max_tokens=5))
    assert max_spec_tokens(s, 8) == 4  # 5 tokens to go: 4 drafts + the target's own token
    s.output_ids += [7, 7, 7, 7]
    assert max_spec_tokens(s, 8) == 0  # one token left: plain decoding
    s = engine.new_session("b", list(range(509)), SamplingParams(max_tokens=100))
    assert max_spec_tokens(s, 8) == 2  # 509 + 3 = the 512-token context


def test_trim_gives_back_the_blocks_of_rejected_drafts():
    bm = BlockSpaceManager(block_size=4, num_blocks=8)
    assert bm.allocate_slots("a", 6)
    assert bm.allocate_slots("a", 1 + 8)  # the last token + 8 drafts: 15 slots, 4 blocks
    assert len(bm.block_tables["a"]) == 4 and bm.num_free_blocks == 4
    bm.trim("a", 9)  # 2 drafts accepted
    assert len(bm.block_tables["a"]) == 3 and bm.num_tokens["a"] == 9 and bm.num_free_blocks == 5
    with pytest.raises(ValueError, match="holds 9"):
        bm.trim("a", 10)
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_greedy_verification_keeps_drafts_up_to_the_first_miss():
    logits = torch.full((4, 6), -5.0)
    logits[torch.arange(4), torch.tensor([2, 4, 1, 5])] = 5.0  # the target's argmax at each position
    g = [torch.Generator()]
    greedy = [SamplingParams(temperature=0)]
    assert rs.rejection_sample(logits, [[2, 4, 0]], [None], greedy, g) == [[2, 4, 1]]  # miss at 2: its own 1
    assert rs.rejection_sample(logits, [[2, 4, 1]], [None], greedy, g) == [[2, 4, 1, 5]]  # all pass: a bonus
    assert rs.rejection_sample(logits[:2], [[3]], [None], greedy, g) == [[2]]  # a miss at once: one token


def test_rejection_sampling_accepts_what_the_target_agrees_with():
    p_logits = torch.tensor([[0.0, 0.0, -1e9], [0.0, -1e9, 0.0]])  # p0 = (.5, .5, 0), p1 = (.5, 0, .5)
    params = [SamplingParams(temperature=1.0)]
    g = torch.Generator().manual_seed(0)
    q_same = torch.softmax(p_logits[:1], dim=-1)
    for _ in range(50):  # q == p: never rejected, and the bonus comes from p1 (never token 1)
        out = rs.rejection_sample(p_logits, [[1]], [q_same], params, [g])[0]
        assert out[0] == 1 and out[1] in (0, 2)
    for _ in range(50):  # a guess the target gives no mass: always rejected, replaced by a draw from p0
        assert rs.rejection_sample(p_logits, [[2]], [None], params, [g])[0] in ([0], [1])


def test_rejection_sampling_turns_draws_from_q_into_draws_from_p():
    """One position: drafts drawn from q = (.8, .1, .1), target p = (.2, .3, .5). The first token out must be
    distributed as p, though 80% of the drafts are token 0 (4,000 seeded draws; 5 standard deviations)."""
    p_logits = torch.tensor([[0.2, 0.3, 0.5], [1.0, 1.0, 1.0]]).log()
    q = torch.tensor([[0.8, 0.1, 0.1]])
    params, g = [SamplingParams(temperature=1.0)], torch.Generator().manual_seed(1)
    first = torch.zeros(3)
    for _ in range(4000):
        d = int(torch.multinomial(q[0], 1, generator=g))
        first[rs.rejection_sample(p_logits, [[d]], [q], params, [g])[0][0]] += 1
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
def hf_alone(hf_model, engine) -> dict[str, list[int]]:
    return {p: hf_greedy(hf_model, engine.encode_prompt(p), GREEDY.max_tokens) for p in (REPEAT, PROMPTS[1])}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_alone_equals_hugging_face(method, k, hf_alone):
    llm = make(ngram(k) if method == "ngram" else draft(k))
    for prompt, want in hf_alone.items():
        assert token_ids(llm, [prompt], GREEDY)[0] == want
    assert_no_leak(llm)


@pytest.mark.parametrize("spec", [draft(4), "random", draft(8, DEFAULT_MODEL), ngram(4)])
def test_greedy_under_preemption_chunked_prefill_and_prefix_caching(spec, reference, random_draft):
    """A 10-block pool for 9 requests: they preempt each other; prompts arrive in 8-token chunks and the
    shared ones hit the prefix cache. Drafts: the bundled one, a random one (nearly always wrong), the target
    itself (always right: every step ends with a bonus token), n-gram lookup."""
    spec = draft(4, random_draft) if spec == "random" else spec
    llm = make(spec, num_blocks=10, block_size=8, max_num_batched_tokens=24, max_num_seqs=6)
    assert token_ids(llm, [*PROMPTS, REPEAT], GREEDY) == reference
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    assert_no_leak(llm)


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
    from roseinfer import BeamSearchParams

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

    from roseinfer.sampling import filtered_probs

    hf = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    paths = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for path, prob in paths.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(path)])).logits[0, -1:]
            p = filtered_probs(logits, [params])[0]
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
def expected_paths(engine) -> tuple[list[int], dict]:
    prompt = engine.encode_prompt(REPEAT)
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

    def accept_all(logits, drafts, draft_probs, params, generators):
        out, row = [], 0
        for d, p in zip(drafts, params, strict=True):
            rows = logits[row : row + len(d) + 1]
            row += len(d) + 1
            out.append(list(d) + rs.rejection_sample(rows[len(d) :], [[]], [None], [p], [torch.Generator()])[0])
        return out

    monkeypatch.setattr("roseinfer.model_runner.rejection_sample", accept_all)
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
            line = next(x for x in metrics.splitlines() if x.startswith(f"roseinfer:spec_decode_{name}_total"))
            assert float(line.split()[-1]) == stats[f"spec_decode_{name}"] > 0
        assert 'roseinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="roseinfer",position="0"}' in metrics
        assert_engine_empty(engine)


def test_roseinfer_serve_takes_a_speculative_config():
    from roseinfer.cli import main

    with pytest.raises(SystemExit):  # --help lists it
        main(["serve", "--help"])
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])


def test_spec_decode_example_runs():
    from conftest import run_python

    r = run_python("scripts/spec_decode_example.py", "--max-tokens", "24", "--steps", "4")
    assert r.returncode == 0, r.stderr
    assert "same tokens" in r.stdout and "False" not in r.stdout
