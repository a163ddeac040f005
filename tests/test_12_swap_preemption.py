"""Stage 12: preemption by swapping KV blocks to a host pool, and the watermark at admission."""

from __future__ import annotations

import pytest
import test_11_fork_and_beam_search as t11
import torch
from conftest import core, hf_greedy, run_python
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from roseinfer import LLM, BeamSearchParams, LLMEngine, SamplingParams
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.worker.kv_cache import swap_blocks

BS = t11.BS
PROMPTS = ["Romeo.\n", "Enter the Ghost.\n", "KING.", "Nurse.\n", "To be, or not to be", "O Romeo, Romeo!"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MODES = [None, "recompute", "swap"]


def swap_gib(num_blocks: int, block_size: int = BS) -> float:
    """`swap_space` in GiB that holds `num_blocks` blocks of the bundled model (fp32: 8 KiB per token)."""
    return num_blocks * block_size * 2 * 4 * 256 * 4 / 2**30


def tight(mode, num_blocks=12, swap_blocks=64, max_num_seqs=6, **kw) -> LLM:
    """A pool so small that the six prompts preempt each other every few steps."""
    return LLM(device="cpu", dtype="float32", block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
               preemption_mode=mode, swap_space=swap_gib(swap_blocks), **kw)  # fmt: skip


def assert_no_leak(llm: LLM):
    kv = core(llm.llm_engine).kv_cache_manager
    assert kv.stats().used_blocks == 0 and len(kv.cpu_pool.free) == kv.num_cpu_blocks
    assert not kv.block_tables and not kv.cpu_tables and not core(llm.llm_engine).scheduler.has_unfinished_requests()


# ---- the host pool in the block manager: a state machine --------------------------------------------------
class SwapMachine(t11.ForkMachine):
    """Stage 11's machine (admit, grow, fork, free, with a content model of every block) plus swapping sets
    of sequences out to a small host pool and back. The copies the manager asks for are applied to the
    content model, so a swapped sequence that came back reading another's tokens would fail."""

    def __init__(self):
        super().__init__()
        self.bm = KVCacheManager(block_size=BS, num_blocks=16, num_cpu_blocks=10)
        self.swapped: dict[str, list[int]] = {}
        self.host: dict[int, list[int | None]] = {}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), grow=st.integers(1, 5))
    def grow(self, data, grow):  # also: blocks_needed is exactly what allocate_slots takes
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        need, free = self.bm.blocks_needed([(sid, grow)]), self.bm.num_free_blocks
        old = len(self.seqs[sid])
        if blocks := self.bm.allocate_slots(sid, grow):
            assert free - self.bm.num_free_blocks == need
            self._apply_copies(blocks)
            self.seqs[sid] += [hash((sid, old + i)) % 1000 for i in range(grow)]
            self._write(sid, old, old + grow)
        else:
            assert need > free

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=3, unique=True))
        if self.bm.can_swap_out(ids):
            pairs = self.bm.swap_out(ids)
            assert len({d for d, _ in pairs}) == len(pairs) == len({b for s in ids for b in self.bm.cpu_tables[s]})
            for d, h in pairs:
                self.host[h] = list(self.content[d])
            for s in ids:
                self.swapped[s] = self.seqs.pop(s)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        if self.bm.can_swap_in(ids):
            for h, d in self.bm.swap_in(ids):
                self.content[d] = list(self.host[h])
            for s in ids:
                self.seqs[s] = self.swapped.pop(s)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):  # an abort while swapped
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        self.bm.free(sid)
        del self.swapped[sid]

    @invariant()
    def host_books_and_contents_agree(self):
        pool, tables = self.bm.cpu_pool, self.bm.cpu_tables
        assert set(tables) == set(self.swapped) and not set(tables) & set(self.bm.block_tables)
        for b in range(pool.num_blocks):
            holders = sum(t.count(b) for t in tables.values())
            assert pool.ref_count[b] == holders and (b in pool.free) == (holders == 0)
        for sid, tokens in self.swapped.items():
            got = [self.host[tables[sid][p // BS]][p % BS] for p in range(len(tokens))]
            assert got == tokens, sid

    def teardown(self):
        for sid in list(self.swapped):
            self.bm.free(sid)
        assert len(self.bm.cpu_pool.free) == 10
        super().teardown()


TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


# ---- swap_blocks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_swap_blocks_copies_exactly_the_pairs_in_every_layer(dtype):
    g = torch.Generator().manual_seed(0)
    device = [(torch.randn(8, 4, 2, 3, generator=g).to(dtype), torch.randn(8, 4, 2, 3, generator=g).to(dtype))
              for _ in range(3)]  # fmt: skip
    host = [(torch.zeros(5, 4, 2, 3, dtype=dtype), torch.zeros(5, 4, 2, 3, dtype=dtype)) for _ in range(3)]
    swap_blocks(device, host, [(6, 0), (1, 3), (2, 4)])
    for (dk, dv), (hk, hv) in zip(device, host, strict=True):
        for d, h in [(6, 0), (1, 3), (2, 4)]:
            assert torch.equal(hk[h], dk[d]) and torch.equal(hv[h], dv[d])
        assert not hk[[1, 2]].any() and not hv[[1, 2]].any()  # blocks nobody copied into stay as they were
    back = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in device]
    swap_blocks(host, back, [(0, 7), (3, 0)])
    for (dk, dv), (bk, bv) in zip(device, back, strict=True):
        assert torch.equal(bk[7], dk[6]) and torch.equal(bv[0], dv[1]) and not bk[1:7].any()


# ---- the engine under memory pressure ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def solo_outputs():
    llm = LLM(device="cpu", dtype="float32", block_size=BS)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_request_equals_its_solo_output_and_hf_under_pressure(mode, solo_outputs, hf_model, tokenizer):
    llm = tight(mode)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] >= 5  # preemption every few steps
    assert (stats["num_swapped_out"] > 0) == (mode == "swap")
    assert stats["num_swapped_in"] == stats["num_swapped_out"]
    assert [o.token_ids for o in outs] == solo_outputs
    for o in outs:
        assert o.token_ids == hf_greedy(hf_model, tokenizer.encode(o.prompt), 20)
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_and_n_under_pressure_equal_their_unpressured_results(mode):
    roomy = LLM(device="cpu", dtype="float32", block_size=BS)
    llm = tight(mode, num_blocks=30, max_num_seqs=12)
    beam = BeamSearchParams(3, 12, ignore_eos=True)
    assert [[s.token_ids for s in o.sequences] for o in llm.beam_search(PROMPTS[:4], beam)] == [
        [s.token_ids for s in o.sequences] for o in roomy.beam_search(PROMPTS[:4], beam)
    ]
    sampled = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)
    a = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS[:4], sampled, use_tqdm=False)]
    b = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:4], sampled, use_tqdm=False)]
    assert a == b
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and (stats["num_swapped_out"] > 0) == (mode != "recompute")
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_blocks", range(8, 16))
def test_a_group_short_of_blocks_while_being_booked_is_preempted_whole(mode, num_blocks):
    """A group's sequences are booked together: a beam that needs a block after its sibling got one used to
    preempt the sibling too, after it had been scheduled (stage 11 then failed with a KeyError)."""
    eng = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=num_blocks, max_num_seqs=8,
                    preemption_mode=mode, swap_space=swap_gib(32))  # fmt: skip
    eng.add_request("a", list(range(1, 6)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_request("b", list(range(7, 12)), BeamSearchParams(2, 10, ignore_eos=True))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["a"].finished and outs["b"].finished and core(eng).kv_cache_manager.stats().used_blocks == 0


def test_swapped_requests_come_back_before_new_ones_and_a_swap_step_admits_nobody():
    eng = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=12, max_num_seqs=4,
                    preemption_mode="swap", swap_space=swap_gib(32), watermark=0.0)  # fmt: skip
    eng.trace = []
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
        t = eng.trace[-1]
        if t["blocks_to_swap_out"]:
            assert t["scheduled_new_reqs"] == [] and t["blocks_to_swap_in"] == []
        if t["swapped"]:
            assert t["scheduled_new_reqs"] == []  # nobody overtakes a swapped request
    assert any(t["blocks_to_swap_out"] for t in eng.trace) and any(t["blocks_to_swap_in"] for t in eng.trace)
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_when_the_host_pool_is_full_a_swap_falls_back_to_recompute(solo_outputs):
    llm = tight("swap", swap_blocks=4)  # room for one short request at most
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats["num_swapped_out"] < stats["num_preemptions"]
    assert [o.token_ids for o in outs] == solo_outputs
    assert_no_leak(llm)


def test_a_request_aborted_while_swapped_frees_its_host_blocks():
    eng = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=12, max_num_seqs=4,
                    preemption_mode="swap", swap_space=swap_gib(32), watermark=0.0)  # fmt: skip
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(str(i), p, GREEDY)
    while not core(eng).scheduler.swapped:
        eng.step()
    victim = core(eng).scheduler.swapped[0].request_id
    assert eng.get_stats()["swap_blocks_used"] > 0
    eng.abort_request(victim)
    assert eng.get_stats()["swap_blocks_used"] == 0 and victim not in core(eng).kv_cache_manager.cpu_tables
    while eng.has_unfinished_requests():
        eng.step()
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_the_watermark_holds_admission_back_only_while_others_run():
    eng = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=20, watermark=0.25)
    assert core(eng).kv_cache_manager.watermark_blocks == 5
    eng.add_request("a", list(range(1, 41)), SamplingParams(temperature=0, max_tokens=2))  # 10 blocks
    eng.add_request("b", list(range(100, 124)), SamplingParams(temperature=0, max_tokens=2))  # 6 more: 4 < 5 left
    eng.step()
    assert [s.request_id for s in core(eng).scheduler.running] == ["a"]  # b waits: it would eat into the watermark
    while eng.has_unfinished_requests():
        eng.step()
    big = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=20, watermark=0.25)
    big.add_request("c", list(range(1, 77)), SamplingParams(temperature=0, max_tokens=2))  # 19 of 20 blocks
    big.step()  # nothing else runs: the watermark does not apply
    assert [s.request_id for s in core(big).scheduler.running] == ["c"]


def test_an_impossible_request_is_still_refused_at_submission():
    eng = LLMEngine(device="cpu", block_size=BS, num_blocks=8, preemption_mode="swap", swap_space=swap_gib(100))
    with pytest.raises(ValueError, match="whole KV cache pool has 8"):
        eng.add_request("x", list(range(1, 40)), SamplingParams(max_tokens=4))
    assert not eng.has_unfinished_requests()


def test_stats_and_defaults():
    eng = LLMEngine(device="cpu", dtype="float32", block_size=BS, num_blocks=100)
    assert (
        core(eng).scheduler.config.preemption_mode is None and core(eng).kv_cache_manager.watermark_blocks == 1
    )  # vLLM: 0.01
    assert core(eng).kv_cache_manager.num_cpu_blocks == 4 * 2**30 // (8192 * BS)  # swap_space=4 GiB
    stats = eng.get_stats()
    assert {"num_swapped_out", "num_swapped_in", "swap_blocks_used", "swap_blocks_total"} <= set(stats)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLMEngine(device="cpu", preemption_mode="drop")


def test_swap_example_runs():
    r = run_python("examples/swap_example.py", "--requests", "6", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "swapped out" in r.stdout and "recompute" in r.stdout
