"""Stage 10: prefix caching: reference-counted blocks, content hashes, an LRU free queue, shared prefixes."""

from __future__ import annotations

import pytest
from conftest import core, greedy_ids, hf_greedy, make_random_checkpoint, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from roseinfer import LLM, LLMEngine, SamplingParams
from roseinfer.core.block_pool import BlockPool, FreeBlockQueue, hash_block
from roseinfer.core.kv_cache_manager import KVCacheManager

BS = 4  # a small block size makes every prefix length relative to a block easy to hit


def hashes_of(tokens: list[int], block_size: int = BS) -> list[bytes]:
    out = []
    for i in range(len(tokens) // block_size):
        out.append(hash_block(out[-1] if out else None, tokens[i * block_size : (i + 1) * block_size]))
    return out


# ---- the pieces ---------------------------------------------------------------------------------------
def test_a_block_hash_names_the_whole_prefix():
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [9, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b, [5, 6, 7, 8])  # same tokens, other prefix
    assert hash_block(a, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert len(a) == 32  # SHA-256


def test_free_queue_is_least_recently_freed_first():
    q = FreeBlockQueue([0, 1, 2, 3])
    assert q.popleft() == 0
    q.append(0)  # freed again: now the most recent
    q.remove(2)  # revived from the middle
    assert list(q) == [1, 3, 0] and 2 not in q and len(q) == 3


def test_pool_evicts_a_free_cached_block_only_when_it_is_handed_out_again():
    pool = BlockPool(3, enable_caching=True)
    blocks = [pool.get_free_block() for _ in range(3)]
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(blocks[0], h)
    for b in blocks:
        pool.free_block(b)
    assert pool.lookup([h]) == [blocks[0]]  # free, but still findable
    pool.touch(blocks[0])  # revived by a hit: leaves the queue
    assert blocks[0] not in pool.free and pool.ref_count[blocks[0]] == 1
    pool.free_block(blocks[0])
    assert [pool.get_free_block() for _ in range(2)] == blocks[1:]  # least recently freed first
    assert pool.lookup([h]) == [blocks[0]]
    assert pool.get_free_block() == blocks[0] and pool.lookup([h]) == []  # handed out: the hash is gone


def test_admission_shares_full_blocks_and_always_leaves_a_token_to_compute():
    bm = KVCacheManager(block_size=BS, num_blocks=16, enable_prefix_caching=True)
    prompt = list(range(1, 13))  # exactly 3 blocks
    h = hashes_of(prompt)
    assert bm.find_cached_blocks(h, len(prompt)) == []
    assert bm.allocate_slots("a", 12, h)
    assert len(bm.pool.cached) == 3  # registered: full once this step's forward has run
    hits = bm.find_cached_blocks(h, len(prompt))
    assert hits == bm.block_tables["a"][:2]  # 12 tokens: 2 blocks shared, the last block computed again
    assert bm.allocate_slots("b", 12 - 8, h, hits)
    assert bm.block_tables["b"][:2] == hits and bm.block_tables["b"][2] != bm.block_tables["a"][2]
    assert [bm.pool.ref_count[x] for x in hits] == [2, 2]
    longer = prompt + [20, 21, 22]  # 3 blocks + 3 tokens: all 3 full blocks can be shared
    assert bm.find_cached_blocks(hashes_of(longer), len(longer)) == bm.block_tables["a"]
    assert bm.find_cached_blocks(hashes_of([1, 2, 3]), 3) == []  # shorter than a block
    bm.free("a")
    assert [bm.pool.ref_count[x] for x in hits] == [1, 1]  # b still holds them
    bm.free("b")
    assert bm.stats().used_blocks == 0
    assert len(bm.pool.cached) == 3  # b's copy of the last block has a's hash: only one of them is cached


def test_freeing_puts_the_tail_first_so_a_prefix_outlives_its_tail():
    bm = KVCacheManager(block_size=BS, num_blocks=6, enable_prefix_caching=True)
    tokens = list(range(1, 13))
    assert bm.allocate_slots("a", 12, hashes_of(tokens))
    table = list(bm.block_tables["a"])
    bm.free("a")
    assert list(bm.free_block_ids)[-3:] == table[::-1]  # tail freed first: evicted first
    assert bm.allocate_slots("x", 4 * BS)  # needs 4 of 6: the 3 never-used blocks and a's tail
    assert bm.pool.lookup(hashes_of(tokens)) == table[:2]  # a's first two blocks survive


def test_a_block_is_never_both_cached_for_two_hashes_or_shared_while_partial():
    bm = KVCacheManager(block_size=BS, num_blocks=8, enable_prefix_caching=True)
    tokens = list(range(1, 7))  # 1.5 blocks
    assert bm.allocate_slots("a", 6, hashes_of(tokens))
    assert len(bm.pool.cached) == 1  # the partial second block is private
    assert bm.find_cached_blocks(hashes_of(tokens + [7, 8, 9]), 9) == bm.block_tables["a"][:1]


# ---- a state machine over the block manager ------------------------------------------------------------
PREFIXES = [[7] * 5, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9]]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes, growth, preemption-like frees; the books must always agree
    with a model of what each block holds."""

    def __init__(self):
        super().__init__()
        self.bm = KVCacheManager(block_size=BS, num_blocks=12, enable_prefix_caching=True)
        self.seqs: dict[str, list[int]] = {}  # id -> its tokens whose K/V are in its blocks
        self.content: dict[int, list[int | None]] = {}  # block -> what was written into each slot
        self.named: dict[bytes, list[int]] = {}  # block hash -> the block's own tokens
        self.n = 0

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        hashes = hashes_of(tokens)
        for i, h in enumerate(hashes):
            self.named[h] = tokens[i * BS : (i + 1) * BS]
        return hashes

    def _write(self, sid: str, start: int, end: int) -> None:
        table, tokens = self.bm.block_tables[sid], self.seqs[sid]
        for pos in range(start, end):
            slots = self.content.setdefault(table[pos // BS], [None] * BS)
            slots[pos % BS] = tokens[pos]

    @rule(prefix=st.sampled_from(PREFIXES), own=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, prefix, own):
        tokens = prefix + own
        sid, self.n = f"s{self.n}", self.n + 1
        hashes = self._hashes(tokens)
        hits = self.bm.find_cached_blocks(hashes, len(tokens))
        if self.bm.allocate_slots(sid, len(tokens) - len(hits) * BS, hashes, hits):
            self.seqs[sid] = tokens
            self._write(sid, len(hits) * BS, len(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), grow=st.integers(1, 6))
    def grow(self, data, grow):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        old = len(self.seqs[sid])
        tokens = self.seqs[sid] + [old % 3] * grow
        if self.bm.allocate_slots(sid, grow, self._hashes(tokens)):
            self.seqs[sid] = tokens
            self._write(sid, old, len(tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @invariant()
    def books_agree(self):
        pool, tables = self.bm.pool, self.bm.block_tables
        for b in range(pool.num_blocks):
            holders = sum(t.count(b) for t in tables.values())
            assert pool.ref_count[b] == holders, f"block {b}: ref {pool.ref_count[b]}, held by {holders} tables"
            assert (b in pool.free) == (holders == 0), f"block {b} is both free and held, or neither"
        for h, b in pool.cached.items():  # a cached block holds exactly the tokens its hash names, never stale
            assert pool.block_hash[b] == h
            assert self.content[b] == self.named[h], f"block {b} holds {self.content[b]}, cached as {self.named[h]}"

    def teardown(self):
        for sid in list(self.seqs):
            self.bm.free(sid)
        assert self.bm.stats().used_blocks == 0 and all(r == 0 for r in self.bm.pool.ref_count)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---- the engine --------------------------------------------------------------------------------------
SYSTEM = (
    "You are Hamlet, Prince of Denmark. Answer every question in blank verse, briefly, as the Prince "
    "would answer it on the battlements of Elsinore at midnight, with the Ghost of his father near.\n\n"
)


def run_all(eng: LLMEngine) -> dict[str, object]:
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return done


def test_a_second_request_with_the_same_prefix_computes_only_its_own_tokens():
    eng = LLMEngine(device="cpu", dtype="float32", block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    eng.add_request("a", SYSTEM + "Who are you?", greedy)
    first = run_all(eng)["a"]
    eng.add_request("b", SYSTEM + "Where is Ophelia?", greedy)
    eng.trace = []
    second = run_all(eng)["b"]
    a_ids, b_ids = first.prompt_token_ids, second.prompt_token_ids
    common = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y)  # tokens in common
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == min(common // 8, (len(b_ids) - 1) // 8) * 8 >= 32
    assert eng.trace[0]["num_scheduled_tokens"]["b"] == len(second.prompt_token_ids) - second.num_cached_tokens
    stats = eng.get_stats()
    assert stats["prefix_cache_hits"] == second.num_cached_tokens
    assert stats["prefix_cache_queries"] == len(first.prompt_token_ids) + len(second.prompt_token_ids)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == core(eng).kv_cache_manager.num_blocks
    assert stats["num_preemptions"] == 0 and stats["kv_blocks_cached"] > 0
    nocache = LLMEngine(device="cpu", dtype="float32", block_size=8, enable_prefix_caching=False)
    nocache.add_request("b", SYSTEM + "Where is Ophelia?", greedy)
    assert run_all(nocache)["b"].token_ids == second.token_ids


def test_a_full_hit_still_computes_the_last_token(hf_model):
    eng = LLMEngine(device="cpu", dtype="float32", block_size=4)
    prompt = list(range(100, 116))  # exactly 4 blocks
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", prompt, p)
    eng.add_request("b", prompt, p)  # admitted in the same step: hits a's blocks as a computes them
    eng.trace = []
    done = run_all(eng)
    assert done["b"].num_cached_tokens == 12  # 3 of 4 blocks: the 4th holds the token whose logits we need
    assert eng.trace[0]["num_scheduled_tokens"] == {"a": 16, "b": 4}
    assert done["a"].token_ids == done["b"].token_ids == hf_greedy(hf_model, prompt, 6)


def test_preempting_and_aborting_sharing_requests_only_drops_their_references(llm):
    eng = LLMEngine(device="cpu", block_size=4, num_blocks=12, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prefix = list(range(1, 9))  # 2 blocks, shared by all
    for i in range(4):
        eng.add_request(str(i), prefix + [20 + i], p)
    eng.step()
    bm = core(eng).kv_cache_manager
    shared = bm.block_tables["0"][:2]
    assert all(bm.block_tables[str(i)][:2] == shared for i in range(4))
    assert [bm.pool.ref_count[b] for b in shared] == [4, 4]
    eng.abort_request("1")
    assert [bm.pool.ref_count[b] for b in shared] == [3, 3]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert core(eng).scheduler.num_preemptions > 0  # 3 requests growing 20 tokens in 12 blocks
    assert bm.stats().used_blocks == 0
    for rid in ("0", "2", "3"):  # each as it runs alone
        assert done[rid] == greedy_ids(llm, prefix + [20 + int(rid)], 20, ignore_eos=True), rid


# ---- random traffic: caching on and off give the same tokens ----------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny10"), seed=11, n_positions=64, n_embd=64, n_layer=2)


PREFIX_LENS = [3, BS, 2 * BS, 2 * BS + 3, 5 * BS]  # shorter than a block, k blocks, k blocks + a few, long
request = st.tuples(
    st.integers(0, 2),  # arrives after this many steps
    st.sampled_from(PREFIX_LENS),  # the shared prefix it starts with
    st.lists(st.integers(0, 4094), min_size=0, max_size=9),  # its own tokens
    st.integers(1, 10),  # max_tokens
    st.booleans(),  # seeded sampling instead of greedy
    st.booleans(),  # aborted after two steps
)


def _drive(model_dir, reqs, caching, num_blocks, budget):
    eng = LLMEngine(model_dir, device="cpu", dtype="float32", block_size=BS, num_blocks=num_blocks, max_num_seqs=3,
                    max_num_batched_tokens=budget, enable_prefix_caching=caching)  # fmt: skip
    base = list(range(200, 200 + 5 * BS))
    pending = [(gap, str(i), base[:n] + own, k, s, ab) for i, (gap, n, own, k, s, ab) in enumerate(reqs)]
    done, step, abort_at = {}, 0, {}
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= 0:
            _, rid, prompt, k, sampled, abort = pending.pop(0)
            params = SamplingParams(temperature=0.9 if sampled else 0, seed=int(rid), max_tokens=k, ignore_eos=True)
            eng.add_request(rid, prompt, params)
            if abort:
                abort_at[rid] = step + 2
        pending = [(gap - 1, *rest) for gap, *rest in pending]
        for rid, when in list(abort_at.items()):
            if when == step and rid in eng.output_processor.requests:
                eng.abort_request(rid)
        if eng.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        step += 1
    assert core(eng).kv_cache_manager.stats().used_blocks == 0, "KV blocks leaked"
    return {rid: ids for rid, ids in done.items() if rid not in abort_at}, eng


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=7), num_blocks=st.integers(10, 24), budget=st.integers(3, 40))
def test_outputs_are_the_same_with_and_without_prefix_caching(tiny_model, reqs, num_blocks, budget):
    cached, eng = _drive(tiny_model, reqs, True, num_blocks, budget)
    plain, _ = _drive(tiny_model, reqs, False, num_blocks, budget)
    assert cached == plain
    pool = core(eng).kv_cache_manager.pool
    assert all(pool.block_hash[b] == h for h, b in pool.cached.items())


def test_llm_has_prefix_caching_on_by_default_and_reports_cached_tokens():
    llm = LLM(device="cpu")
    outs = llm.generate([SYSTEM + "Speak.", SYSTEM + "Be silent."], SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)  # fmt: skip
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    off = LLM(device="cpu", enable_prefix_caching=False)
    assert (
        off.generate([SYSTEM + "Be silent."], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids
        == outs[1].token_ids
    )


def test_prefix_cache_example_shows_cached_tokens():
    r = run_python("examples/prefix_cache_example.py", "--num-requests", "4", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout and "outputs equal with and without the prefix cache" in r.stdout


# ---- cascade attention: decodes that share a cached prefix ------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_cascade_attention_equals_the_reference(seed):
    import torch

    from roseinfer.attention import SDPA_BACKEND, AttentionMetadata
    from roseinfer.attention.reference import attention_reference
    from roseinfer.attention.sdpa import attention_sdpa, plan_sdpa

    g = torch.Generator().manual_seed(seed)
    H, D, bs, nb = 3, 16, 4, 64
    k_cache, v_cache = torch.randn(nb, bs, H, D, generator=g) * 3, torch.randn(nb, bs, H, D, generator=g)
    prefix = [5, 9, 2, 7, 11]  # 5 shared blocks (20 tokens)
    free = iter(range(20, nb))
    lens = sorted((len(prefix) * bs + int(torch.randint(1, 13, (1,), generator=g)) for _ in range(6)), reverse=True)
    tables = [prefix + [next(free) for _ in range(-(-n // bs) - len(prefix))] for n in lens]
    width = max(map(len, tables))
    starts = list(range(len(lens) + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=len(lens), max_query_len=1, query_start_loc_cpu=starts, seq_lens_cpu=lens, backend=SDPA_BACKEND,
    )  # fmt: skip
    plan = plan_sdpa(meta, bs)
    assert plan.prefix_blocks.tolist() == prefix  # every row starts with them: attended once
    meta.plan = plan
    q = torch.randn(len(lens), H, D, generator=g)
    ref = attention_reference(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5)
    out = attention_sdpa(q, q, q, k_cache, v_cache, meta, D**-0.5)  # key/value are not read for decodes
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
