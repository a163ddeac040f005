"""Stage 04: KV block bookkeeping (KVCacheManager: ids only) and its use by the engine."""

from __future__ import annotations

import pytest
from conftest import core, greedy_ids, run_all
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer import EngineArgs, SamplingParams
from roseinfer.config import SchedulerConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.request import Request
from roseinfer.core.sched.runner_view import RunnerView
from roseinfer.core.sched.scheduler import Scheduler


# ---- unit tests ------------------------------------------------------------------------
def test_pool_size_from_num_blocks_or_memory_budget():
    assert KVCacheManager(block_size=16, num_blocks=10).num_blocks == 10
    cfg = EngineArgs(device="cpu", block_size=16, kv_cache_memory=1_000_000).create_engine_config()
    hf = cfg.model_config.hf_config
    assert cfg.model_config.kv_bytes_per_token() == 2 * hf.n_layer * hf.n_embd * 4 == 8192  # K and V, fp32
    assert cfg.cache_config.num_gpu_blocks == 1_000_000 // (8192 * 16) == 7
    with pytest.raises(ValueError, match="kv_cache_memory=1000 bytes holds no KV block"):
        EngineArgs(device="cpu", block_size=16, kv_cache_memory=1000).create_engine_config()
    with pytest.raises(ValueError, match="at least one block"):
        KVCacheManager(block_size=16, num_blocks=0)
    with pytest.raises(TypeError, match="num_blocks"):
        KVCacheManager(block_size=16)  # the pool size is required
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(block_size=0, num_blocks=4)


def test_allocate_slots_ok_later_never():
    """OK: the blocks are free now; LATER: allocate_slots says False and takes nothing; NEVER: the
    scheduler refuses a request that needs more blocks than the whole pool, at submission."""
    bm = KVCacheManager(block_size=4, num_blocks=3)
    assert not bm.allocate_slots("x", 13)  # 4 blocks > 3 in the pool
    assert "x" not in bm.block_tables and bm.num_free_blocks == 3
    assert bm.allocate_slots("x", 12)  # exactly the pool
    bm.free("x")
    assert bm.allocate_slots("a", 5)  # 2 blocks
    assert not bm.allocate_slots("b", 5)  # LATER: 2 blocks, 1 free
    assert "b" not in bm.block_tables and bm.num_free_blocks == 1
    assert bm.allocate_slots("b", 4)  # 1 block fits
    bm.free("b")
    bm.free("a")
    assert bm.allocate_slots("b", 5)
    bm.free("b")
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, enable_chunked_prefill=True,
                             preemption_mode=None, max_model_len=512)  # fmt: skip
    sched = Scheduler(config, KVCacheManager(block_size=4, num_blocks=3))
    greedy = SamplingParams(temperature=0, max_tokens=1)
    sched.check_fits(Request("ok", list(range(1, 12)), greedy, 4095, 512))  # 11 + 1 tokens: 3 blocks
    with pytest.raises(ValueError, match="KV blocks"):
        sched.check_fits(Request("never", list(range(1, 13)), greedy, 4095, 512))  # 12 + 1 tokens: 4 blocks


def _allocate(bm: KVCacheManager, view: RunnerView, sid: str, n: int):
    """allocate_slots, and what it did to the table recorded for the runner (as the scheduler does)."""
    blocks = bm.allocate_slots(sid, n)
    if blocks is not None:
        view.record_blocks(sid, blocks)
    return blocks


def test_allocate_slots_builds_a_block_table():
    bm = KVCacheManager(block_size=4, num_blocks=8)
    view = RunnerView(bm)
    assert _allocate(bm, view, "a", 9)
    table = bm.get_block_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.block_tables["a"] == table and bm.num_tokens["a"] == 9
    assert bm.fill_levels("a") == [4, 4, 1]
    assert view.pop_block_update("a") == (0, table)  # the runner learns the new table once
    assert view.pop_block_update("a") is None
    with pytest.raises(ValueError, match="already"):  # a table is created once: no second admission
        bm.allocate_slots("a", 1, cached_blocks=[table[0]])
    with pytest.raises(ValueError, match="already"):
        bm.fork("a", "a")  # nor by forking into it
    assert bm.get_block_table("a") == table and bm.num_tokens["a"] == 9
    assert not bm.allocate_slots("b", 100)  # does not fit: nothing taken
    assert "b" not in bm.block_tables and bm.num_free_blocks == 5


def test_growth_fills_the_last_block_then_takes_a_new_one():
    bm = KVCacheManager(block_size=4, num_blocks=3)
    view = RunnerView(bm)
    assert _allocate(bm, view, "a", 3)
    view.pop_block_update("a")
    assert _allocate(bm, view, "a", 1)  # 4th slot of block 0
    assert bm.fill_levels("a") == [4] and view.pop_block_update("a") is None  # no new block
    assert _allocate(bm, view, "a", 1)  # 5th token: a new block
    new = bm.get_block_table("a")[-1]
    assert len(bm.get_block_table("a")) == 2 and view.pop_block_update("a") == (1, [new])  # just the new block
    assert bm.fill_levels("a") == [4, 1]
    assert bm.allocate_slots("b", 4)  # takes the last free block
    for _ in range(3):
        assert bm.allocate_slots("a", 1)
    assert bm.fill_levels("a") == [4, 4] and bm.num_free_blocks == 0
    assert not bm.allocate_slots("a", 1)  # block full and none free
    assert bm.num_tokens["a"] == 8 and len(bm.get_block_table("a")) == 2  # nothing changed


def test_free_returns_blocks_and_ignores_unknown_ids():
    bm = KVCacheManager(block_size=4, num_blocks=4)
    assert bm.allocate_slots("a", 6)
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.stats().free_blocks == 4 and not bm.block_tables and not bm.num_tokens


def test_stats_and_fragmentation():
    bm = KVCacheManager(block_size=4, num_blocks=10)
    assert bm.stats().utilization == 1.0
    assert bm.allocate_slots("a", 5)  # 2 blocks, 5 of 8 slots
    assert bm.allocate_slots("b", 4)  # 1 block, full
    s = bm.stats()
    assert (s.used_blocks, s.free_blocks, s.used_slots, s.allocated_slots) == (3, 7, 9, 12)
    assert s.utilization == pytest.approx(9 / 12)
    assert s.fragmentation == pytest.approx(3 / 12)
    snap = bm.snapshot()
    assert snap["block_tables"]["a"] == bm.get_block_table("a") and snap["num_tokens"] == {"a": 5, "b": 4}
    assert snap["stats"] == s


# ---- property test ---------------------------------------------------------------------
ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "extend", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 24), ops=ops)
def test_random_allocate_grow_free_keeps_the_books(block_size, num_blocks, ops):
    bm = KVCacheManager(block_size=block_size, num_blocks=num_blocks)
    lengths: dict[str, int] = {}
    blocks = lambda n: -(-n // block_size)  # noqa: E731
    for op, seq, n in ops:
        sid = f"s{seq}"
        free_before = bm.num_free_blocks
        if op == "alloc" and sid not in lengths:  # a new sequence with an n-token prompt
            ok = blocks(n) <= free_before
            assert (bm.allocate_slots(sid, n) is not None) is ok
            if ok:
                lengths[sid] = n
            else:
                assert sid not in bm.block_tables and bm.num_free_blocks == free_before
        elif op in ("append", "extend") and sid in lengths:  # a decode token, or an n-token chunk
            k = 1 if op == "append" else n
            ok = blocks(lengths[sid] + k) - blocks(lengths[sid]) <= free_before
            assert (bm.allocate_slots(sid, k) is not None) is ok
            if ok:
                lengths[sid] += k
            else:
                assert bm.num_free_blocks == free_before
        elif op == "free":
            bm.free(sid)
            lengths.pop(sid, None)
        # invariants after every operation
        owned = [b for t in bm.block_tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(bm.free_block_ids), "a block is both owned and free"
        assert len(owned) + len(bm.free_block_ids) == num_blocks, "free + used != total"
        assert set(bm.block_tables) == set(lengths)
        for s, n in lengths.items():
            assert len(bm.block_tables[s]) == blocks(n)
            assert bm.num_tokens[s] == n
        stats = bm.stats()
        assert (stats.used_blocks, stats.used_slots) == (len(owned), sum(lengths.values()))
    for s in list(lengths):
        bm.free(s)
    assert sorted(bm.free_block_ids) == list(range(num_blocks)), "blocks leaked"


# ---- integration -----------------------------------------------------------------------
def test_generate_frees_every_block(llm):
    prompts = ["Romeo.\n", "Enter Hamlet, reading.\n" * 3, "To be"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert all(o.finished for o in outs)
    kv = core(llm.llm_engine).kv_cache_manager
    s = kv.stats()
    assert s.used_blocks == 0 and s.free_blocks == kv.num_blocks and not kv.block_tables


def test_blocks_are_free_after_a_request_raised(llm, monkeypatch):
    kv = core(llm.llm_engine).kv_cache_manager
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["Romeo.", ""], use_tqdm=False)
    assert kv.stats().used_blocks == 0
    calls = {"n": 0}
    real = Request.append_token

    def flaky(self, token_id):  # the 5th sampled token blows up, mid-run
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("boom")
        return real(self, token_id)

    monkeypatch.setattr(Request, "append_token", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["Romeo.", "Juliet.", "Nurse."], SamplingParams(max_tokens=8), use_tqdm=False)
    assert kv.stats().used_blocks == 0 and not kv.block_tables
    assert not llm.llm_engine.has_unfinished_requests() and not core(llm.llm_engine).scheduler.requests
    monkeypatch.undo()  # the engine still works afterwards
    assert greedy_ids(llm, "Romeo.", 8)


def test_block_tables_track_each_request(make_engine):
    eng = make_engine(block_size=4, num_blocks=64)
    eng.trace = []
    kv = core(eng).kv_cache_manager
    rid = "r"
    eng.add_request(rid, list(range(1, 11)), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    eng.step()  # prefill: 10 prompt tokens -> 3 blocks
    assert kv.fill_levels(rid) == [4, 4, 2]
    eng.step()  # decode feeds token 11
    assert kv.num_tokens[rid] == 11
    assert len(run_all(eng)[rid]) == 7
    assert kv.stats().used_blocks == 0
    # the trace saw the table grow: 10 tokens, 11, ... 16 (the 7th sampled token is never fed)
    assert [t["num_tokens"].get(rid, 0) for t in eng.trace] == [10, 11, 12, 13, 14, 15, 0]
    assert [len(t["block_tables"].get(rid, [])) for t in eng.trace] == [3, 3, 3, 4, 4, 4, 0]


def test_prompt_bigger_than_the_pool_is_refused_at_submission(make_engine):
    eng = make_engine(block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request("big", list(range(1, 10)), SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests() and not core(eng).scheduler.requests and not core(eng).scheduler.waiting


def test_waiting_for_blocks_then_running(llm, make_engine):
    """Two requests, room for one: the second waits (LATER), then gets the freed blocks."""
    eng = make_engine(block_size=4, num_blocks=3)
    eng.trace = []
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("a", list(range(1, 9)), p)  # 8 tokens: 2 blocks, grows into a 3rd
    eng.add_request("b", list(range(20, 28)), p)
    eng.step()
    assert eng.trace[-1]["ran"] == ["a"] and eng.trace[-1]["waiting"] == ["b"]  # b: LATER
    out = run_all(eng)
    assert [len(out[r]) for r in ("a", "b")] == [4, 4]
    assert out["b"] == greedy_ids(llm, list(range(20, 28)), 4, ignore_eos=True)
    end_a = next(t["step"] for t in eng.trace if "a" in t["finished"])
    assert next(t["step"] for t in eng.trace if "b" in t["ran"]) == end_a + 1  # b starts once a's blocks are free
    assert core(eng).scheduler.num_preemptions == 0 and core(eng).kv_cache_manager.stats().used_blocks == 0


def test_pool_exhausted_mid_run_is_handled_and_leaks_nothing(llm, make_engine):
    """A request that can never fit is refused clearly; two that fit alone but not together both finish
    (the younger one is preempted while the pool is full) with their solo tokens, and nothing leaks."""
    eng = make_engine(block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):  # 8 + 20 tokens: 7 blocks > 4
        eng.add_request("never", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("a", list(range(1, 9)), p)  # both prompts fit (2 + 2 blocks), neither can then grow
    eng.add_request("b", list(range(20, 28)), p)
    out = run_all(eng)
    assert core(eng).scheduler.num_preemptions >= 1
    assert out["a"] == greedy_ids(llm, list(range(1, 9)), 8, ignore_eos=True)
    assert out["b"] == greedy_ids(llm, list(range(20, 28)), 8, ignore_eos=True)
    assert core(eng).kv_cache_manager.stats().used_blocks == 0
