"""Stage 11: fork and copy-on-write: n > 1 completions and beam search, checked against Hugging Face."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import core, make_random_checkpoint, run_python
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from roseinfer import LLM, BeamSearchParams, CompletionOutput, LLMEngine, SamplingParams
from roseinfer.core.kv_cache_manager import KVCacheManager

PROMPTS = ["Romeo.\n", "KING.", "To be, or not to be"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", block_size=4)  # small blocks: many forks and copies


# ---- n > 1 --------------------------------------------------------------------------------------------
def test_n1_output_is_unchanged_and_has_one_completion(llm):
    out = llm.generate(["Romeo.\n"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.outputs == [CompletionOutput(0, out.text, out.token_ids, out.finish_reason)]


def test_greedy_n_gives_n_copies_of_the_greedy_text(llm, hf_model):
    from conftest import hf_greedy

    out = llm.generate(["Romeo.\n"], SamplingParams(temperature=0, max_tokens=12, n=4), use_tqdm=False)[0]
    greedy = hf_greedy(hf_model, llm.tokenizer.encode("Romeo.\n"), 12)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == greedy for c in out.outputs) and out.token_ids == greedy
    logprobs = [c.cumulative_logprob for c in out.outputs]
    assert logprobs[0] < 0 and max(logprobs) - min(logprobs) < 1e-4  # the same tokens, computed in other rows
    assert core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0


def test_each_of_n_samples_draws_from_its_own_seeded_stream(llm):
    p = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=16, n=3)
    a = llm.generate(["KING."], p, use_tqdm=False)[0]
    b = llm.generate(["KING."], p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # reproducible
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # and different from each other
    for i, c in enumerate(a.outputs):  # completion i is what a single request seeded with seed + i gives
        single = SamplingParams(temperature=1.0, top_k=50, seed=7 + i, max_tokens=16)
        assert c.token_ids == llm.generate(["KING."], single, use_tqdm=False)[0].token_ids


def test_the_prompt_runs_once_and_its_blocks_are_shared_then_copied_on_write():
    eng = LLMEngine(device="cpu", block_size=4)
    eng.trace = []
    eng.add_request("r", list(range(10, 20)), SamplingParams(temperature=0, max_tokens=5, n=3, ignore_eos=True))
    eng.step()  # the prompt: 10 tokens in blocks [b0 b1 b2(2 of 4)], then the fork
    t = eng.trace[-1]
    assert t["num_scheduled_tokens"] == {"r": 10}  # computed once
    tables = t["block_tables"]
    assert tables["r"] == tables["r#1"] == tables["r#2"] and all(t["ref_counts"][b] == 3 for b in tables["r"])
    eng.step()  # each appends into the shared, partly filled last block: two of them copy it first
    t = eng.trace[-1]
    after = t["block_tables"]
    last = [after[s][-1] for s in ("r", "r#1", "r#2")]
    assert len(set(last)) == 3 and all(t["ref_counts"][b] == 1 for b in last)
    assert all(after[s][:2] == tables["r"][:2] for s in ("r", "r#1", "r#2"))  # the full blocks stay shared
    while eng.has_unfinished_requests():
        eng.step()
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_n8_uses_fewer_blocks_than_8_separate_requests():
    prompt = list(range(1, 101))  # 100 tokens: 7 blocks of 16
    p = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    peak = {}
    for name, reqs in (("n8", [SamplingParams(**{**vars(p), "n": 8})]), ("8 requests", [p] * 8)):
        eng = LLMEngine(device="cpu", enable_prefix_caching=False)
        for i, sp in enumerate(reqs):
            eng.add_request(str(i), prompt, sp)
        most = 0
        while eng.has_unfinished_requests():
            eng.step()
            most = max(most, core(eng).kv_cache_manager.stats().used_blocks)
        peak[name] = most
    assert peak["n8"] == 6 + 8 and peak["8 requests"] == 8 * 7  # 6 full prompt blocks shared, a last block each


def test_n_larger_than_max_num_seqs_is_refused():
    eng = LLMEngine(device="cpu", max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.add_request("x", "Romeo.", SamplingParams(n=5))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


# ---- fork / copy-on-write in the block manager: a state machine -------------------------------------------
BS = 4


class ForkMachine(RuleBasedStateMachine):
    """Admit, grow, fork and free sequences; the content model applies the copy-on-write pairs the manager
    asks for, so any write into a block another sequence still reads would show up as a wrong token."""

    def __init__(self):
        super().__init__()
        self.bm = KVCacheManager(block_size=BS, num_blocks=16)
        self.seqs: dict[str, list[int]] = {}
        self.content: dict[int, list[int | None]] = {}
        self.n = 0

    def _apply_copies(self, blocks):
        for src, dst in blocks.copies:
            self.content[dst] = list(self.content.get(src, [None] * BS))

    def _write(self, sid, start, end):
        table = self.bm.block_tables[sid]
        for pos in range(start, end):
            self.content.setdefault(table[pos // BS], [None] * BS)[pos % BS] = self.seqs[sid][pos]

    @rule(length=st.integers(1, 9))
    def admit(self, length):
        sid, self.n = f"s{self.n}", self.n + 1
        if self.bm.allocate_slots(sid, length):
            self.seqs[sid] = [self.n * 100 + i for i in range(length)]
            self._write(sid, 0, length)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), grow=st.integers(1, 5))
    def grow(self, data, grow):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        old = len(self.seqs[sid])
        if blocks := self.bm.allocate_slots(sid, grow):
            self._apply_copies(blocks)  # the runner copies before the forward writes
            self.seqs[sid] += [hash((sid, old + i)) % 1000 for i in range(grow)]
            self._write(sid, old, old + grow)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, self.n = f"s{self.n}", self.n + 1
        self.bm.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):  # a finish, an abort or a preemption
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @invariant()
    def books_and_contents_agree(self):
        pool, tables = self.bm.pool, self.bm.block_tables
        for b in range(pool.num_blocks):
            holders = sum(t.count(b) for t in tables.values())
            assert pool.ref_count[b] == holders and (b in pool.free) == (holders == 0)
        for sid, tokens in self.seqs.items():  # every sequence still reads exactly its own tokens
            got = [self.content[tables[sid][p // BS]][p % BS] for p in range(len(tokens))]
            assert got == tokens, sid

    def teardown(self):
        for sid in list(self.seqs):
            self.bm.free(sid)
        assert self.bm.stats().used_blocks == 0 and all(r == 0 for r in self.bm.pool.ref_count)


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


# ---- beam search against Hugging Face -------------------------------------------------------------------
@torch.no_grad()
def hf_beams(model, prompt, W, T, lp, eos):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=W, num_return_sequences=W, do_sample=False,
                         early_stopping=True, length_penalty=lp, max_new_tokens=T, pad_token_id=eos if eos else 0,
                         eos_token_id=eos, return_dict_in_generate=True, output_scores=True)  # fmt: skip
    if W == 1:  # Hugging Face runs greedy search: score it the same way
        gen = out.sequences[0, len(prompt) :].tolist()
        cum = sum(float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, gen, strict=True))
        return [(gen, cum / len(gen) ** lp)]
    lens = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(seq[len(prompt) : len(prompt) + n].tolist(), float(sc))
            for seq, sc, n in zip(out.sequences, out.sequences_scores, lens, strict=True)]  # fmt: skip


def assert_same_beams(ours, theirs):
    assert [s.token_ids for s in ours.sequences] == [t[0] for t in theirs]
    for s, (_, score) in zip(ours.sequences, theirs, strict=True):
        assert abs(s.score - score) < 1e-4


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("lp", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beam_search_equals_hugging_face_on_the_bundled_model(llm, hf_model, W, lp, ignore_eos):
    eos = None if ignore_eos else hf_model.config.eos_token_id
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ours = llm.beam_search([ids], BeamSearchParams(W, 12, ignore_eos=ignore_eos, length_penalty=lp))[0]
        assert_same_beams(ours, hf_beams(hf_model, ids, W, 12, lp, eos))
    assert core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A random GPT-2 whose EOS is a token it likes, so that beams end early and finished hypotheses compete."""
    from transformers import GPT2LMHeadModel

    d = make_random_checkpoint(tmp_path_factory.mktemp("eos11"), seed=4, n_positions=64, n_embd=64, n_layer=2,
                               initializer_range=0.2)  # fmt: skip
    hf = GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        likely = torch.topk(hf(torch.tensor([[5, 6, 7]])).logits[0, -1], 2).indices[1].item()  # its 2nd choice
    for name in ("config.json", "generation_config.json"):  # both say which token ends a sequence
        if (d / name).exists():
            cfg = json.loads((d / name).read_text())
            cfg["eos_token_id"] = likely
            (d / name).write_text(json.dumps(cfg))
    return d, GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("lp", [0.5, 1.0, 2.0])
def test_beam_search_equals_hugging_face_with_eos_in_play(eos_model, W, lp):
    d, hf = eos_model
    llm = LLM(str(d), device="cpu", dtype="float32", block_size=4)
    ended = []
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44]):
        ours = llm.beam_search([prompt], BeamSearchParams(W, 10, length_penalty=lp))[0]
        theirs = hf_beams(hf, prompt, W, 10, lp, hf.config.eos_token_id)
        assert_same_beams(ours, theirs)
        ended += [s.token_ids[-1] == hf.config.eos_token_id for s in ours.sequences]
    if W > 1 and lp < 1:  # a short penalty keeps short hypotheses: EOS really ended some of those returned
        assert any(ended)
    assert core(llm.llm_engine).kv_cache_manager.stats().used_blocks == 0


def test_beams_fork_and_share_blocks_during_the_search():
    eng = LLMEngine(device="cpu", block_size=4)
    eng.trace = []
    eng.add_request("b", "Romeo.\n", BeamSearchParams(4, 10, ignore_eos=True))
    shared = 0
    while eng.has_unfinished_requests():
        eng.step()
        refs = eng.trace[-1]["ref_counts"]
        shared = max(shared, max(refs.values(), default=0))
    assert shared >= 4  # the prompt's blocks are held by all 4 beams
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_preempted_groups_come_back_and_finish_the_same():
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=24, n=3, ignore_eos=True)]
    beam = BeamSearchParams(3, 16, ignore_eos=True)
    roomy = LLM(device="cpu", dtype="float32", block_size=4)
    tight = LLM(device="cpu", dtype="float32", block_size=4, num_blocks=40)  # forces preemptions
    prompts = ["Romeo.\n", "Enter the Ghost.\n", "KING.", "Nurse.\n"]
    a = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params * 4, use_tqdm=False)]
    b = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params * 4, use_tqdm=False)]
    assert a == b and core(tight.llm_engine).scheduler.num_preemptions > 0
    x = [[s.token_ids for s in o.sequences] for o in roomy.beam_search(prompts, beam)]
    y = [[s.token_ids for s in o.sequences] for o in tight.beam_search(prompts, beam)]
    assert x == y
    assert core(tight.llm_engine).kv_cache_manager.stats().used_blocks == 0


def test_bad_beam_search_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 10)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(2, 10, length_penalty=float("nan"))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        LLM(device="cpu").beam_search(["Romeo."], SamplingParams())


def test_beam_search_example_runs():
    r = run_python("examples/beam_search_example.py", "--beam-width", "3", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "beam" in r.stdout and "KV blocks" in r.stdout
