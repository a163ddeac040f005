"""Stage 04: the KV block manager (bookkeeping only) and its use by the scheduler."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer import LLM, SamplingParams
from roseinfer.block_manager import AllocStatus, BlockSpaceManager, NoFreeBlocksError
from roseinfer.scheduler import KVCacheFullError, OfflineScheduler
from roseinfer.session import InferenceSession


# ---- unit tests ------------------------------------------------------------------------
def test_pool_size_from_num_blocks_or_memory_budget():
    assert BlockSpaceManager(block_size=16, num_blocks=10).num_blocks == 10
    bm = BlockSpaceManager(block_size=16, kv_cache_memory=1_000_000, bytes_per_token=8192)
    assert bm.num_blocks == 1_000_000 // (8192 * 16) == 7
    with pytest.raises(ValueError, match="at least one block"):
        BlockSpaceManager(block_size=16, kv_cache_memory=1000, bytes_per_token=8192)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockSpaceManager(block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        BlockSpaceManager(block_size=0, num_blocks=4)


def test_can_allocate_ok_later_never():
    bm = BlockSpaceManager(block_size=4, num_blocks=3)
    assert bm.can_allocate(12) is AllocStatus.OK  # exactly the pool
    assert bm.can_allocate(13) is AllocStatus.NEVER  # 4 blocks > 3 in the pool
    bm.allocate("a", 5)  # 2 blocks
    assert bm.can_allocate(4) is AllocStatus.OK
    assert bm.can_allocate(5) is AllocStatus.LATER
    bm.free("a")
    assert bm.can_allocate(5) is AllocStatus.OK


def test_allocate_builds_a_block_table():
    bm = BlockSpaceManager(block_size=4, num_blocks=8)
    table = bm.allocate("a", 9)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.get_block_table("a") == table
    assert bm.fill_levels("a") == [4, 4, 1]
    with pytest.raises(ValueError, match="already"):
        bm.allocate("a", 1)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 100)
    assert "b" not in bm.block_tables


def test_append_slot_fills_the_last_block_then_takes_a_new_one():
    bm = BlockSpaceManager(block_size=4, num_blocks=3)
    bm.allocate("a", 3)
    assert bm.append_slot("a") is None  # 4th slot of block 0
    assert bm.fill_levels("a") == [4]
    new = bm.append_slot("a")  # 5th token: a new block
    assert new is not None and bm.get_block_table("a")[-1] == new
    assert bm.fill_levels("a") == [4, 1]
    bm.allocate("b", 4)  # takes the last free block
    for _ in range(3):
        assert bm.can_append_slot("a")
        bm.append_slot("a")
    assert not bm.can_append_slot("a")  # block full and none free
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot("a")


def test_free_returns_blocks_and_ignores_unknown_ids():
    bm = BlockSpaceManager(block_size=4, num_blocks=4)
    bm.allocate("a", 6)
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.stats().free_blocks == 4 and not bm.block_tables


def test_stats_and_fragmentation():
    bm = BlockSpaceManager(block_size=4, num_blocks=10)
    assert bm.stats().utilization == 1.0
    bm.allocate("a", 5)  # 2 blocks, 5 of 8 slots
    bm.allocate("b", 4)  # 1 block, full
    s = bm.stats()
    assert (s.used_blocks, s.free_blocks, s.used_slots, s.allocated_slots) == (3, 7, 9, 12)
    assert s.fragmentation == pytest.approx(3 / 12)
    snap = bm.snapshot()
    assert snap["block_tables"]["a"] == bm.get_block_table("a") and snap["num_tokens"] == {"a": 5, "b": 4}


# ---- property test ---------------------------------------------------------------------
ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 5), st.integers(1, 40)), max_size=80
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 24), ops=ops)
def test_random_allocate_append_free_keeps_the_books(block_size, num_blocks, ops):
    bm = BlockSpaceManager(block_size=block_size, num_blocks=num_blocks)
    lengths: dict[str, int] = {}
    for op, seq, n in ops:
        sid = f"s{seq}"
        if op == "alloc" and sid not in lengths:
            status = bm.can_allocate(n)
            if status is AllocStatus.OK:
                bm.allocate(sid, n)
                lengths[sid] = n
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(sid, n)
                assert status is (AllocStatus.NEVER if -(-n // block_size) > num_blocks else AllocStatus.LATER)
        elif op == "append" and sid in lengths:
            if bm.can_append_slot(sid):
                bm.append_slot(sid)
                lengths[sid] += 1
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.append_slot(sid)
        elif op == "free":
            bm.free(sid)
            lengths.pop(sid, None)
        # invariants after every operation
        owned = [b for t in bm.block_tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(bm.free_block_ids), "a block is both owned and free"
        assert len(owned) + len(bm.free_block_ids) == num_blocks, "free + used != total"
        for s, n in lengths.items():
            assert len(bm.block_tables[s]) == -(-n // block_size)
            assert bm.num_tokens[s] == n
    for s in list(lengths):
        bm.free(s)
    assert sorted(bm.free_block_ids) == list(range(num_blocks)), "blocks leaked"


# ---- integration -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


def test_generate_frees_every_block(llm):
    prompts = ["Romeo.\n", "Enter Hamlet, reading.\n" * 3, "To be"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert all(o.finished for o in outs)
    s = llm.block_manager.stats()
    assert s.used_blocks == 0 and s.free_blocks == llm.block_manager.num_blocks


def test_blocks_are_free_after_a_request_raised(llm, monkeypatch):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["Romeo.", ""], use_tqdm=False)
    assert llm.block_manager.stats().used_blocks == 0
    calls = {"n": 0}
    real = InferenceSession.append_token

    def flaky(self, token_id):  # the 5th sampled token blows up, mid-run
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("boom")
        return real(self, token_id)

    monkeypatch.setattr(InferenceSession, "append_token", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["Romeo.", "Juliet.", "Nurse."], SamplingParams(max_tokens=8), use_tqdm=False)
    assert llm.block_manager.stats().used_blocks == 0


def test_block_tables_track_each_session(engine):
    bm = BlockSpaceManager(block_size=4, num_blocks=64)
    sched = OfflineScheduler(engine, bm, trace=True)
    rid = sched.add_request(list(range(1, 11)), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    sched.step()  # prefill: 10 prompt tokens -> 3 blocks
    assert bm.fill_levels(rid) == [4, 4, 2]
    sched.step()  # decode feeds token 11
    assert bm.num_tokens[rid] == 11
    sched.run()
    assert bm.stats().used_blocks == 0
    # the trace saw the table grow: 10 tokens, 11, ... 16 (the 7th sampled token is never fed)
    assert [t["num_tokens"].get(rid, 0) for t in sched.trace] == [10, 11, 12, 13, 14, 15, 0]
    assert [len(t["block_tables"].get(rid, [])) for t in sched.trace] == [3, 3, 3, 4, 4, 4, 0]


def test_prompt_bigger_than_the_pool_is_refused_at_submission(engine):
    sched = OfflineScheduler(engine, BlockSpaceManager(block_size=4, num_blocks=2))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(list(range(1, 10)), SamplingParams(max_tokens=2))
    assert not sched.sessions


def test_waiting_for_blocks_then_running(engine):
    """Two requests, room for one: the second waits (LATER), then gets the freed blocks."""
    bm = BlockSpaceManager(block_size=4, num_blocks=3)
    sched = OfflineScheduler(engine, bm)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = sched.add_request(list(range(1, 9)), p)  # 8 tokens: 2 blocks, grows into a 3rd
    b = sched.add_request(list(range(20, 28)), p)
    assert sched.step() == [a]  # b: LATER
    out = sched.run()
    assert [len(out[r].token_ids) for r in (a, b)] == [4, 4]
    assert out[b].token_ids == engine.generate_ids(list(range(20, 28)), 4)
    assert bm.stats().used_blocks == 0


def test_pool_exhausted_raises_clearly_and_leaks_nothing(engine):
    bm = BlockSpaceManager(block_size=4, num_blocks=4)
    sched = OfflineScheduler(engine, bm)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sched.add_request(list(range(1, 9)), p)  # both prompts fit (2 + 2 blocks), neither can grow
    sched.add_request(list(range(20, 28)), p)
    with pytest.raises(KVCacheFullError, match="KV cache pool exhausted"):
        sched.run()
    assert bm.stats().used_blocks == 0
