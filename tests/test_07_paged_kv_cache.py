"""Stage 07: the paged KV pool, attention metadata, reference paged attention, preemption."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_greedy

from roseinfer import LLMEngine, SamplingParams
from roseinfer.attention import paged_attention, write_kv
from roseinfer.block_manager import BlockSpaceManager
from roseinfer.kv_cache import KVCache
from roseinfer.model_runner import ModelRunner
from roseinfer.scheduler_output import SchedulerOutput
from roseinfer.session import InferenceSession


def _dense(q, ks, vs, scale):
    """Plain attention for one sequence: q [H, D], ks/vs [L, H, D] -> [H, D]."""
    scores = torch.einsum("hd,lhd->hl", q, ks) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vs)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_paged_attention_equals_dense(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    H, D, num_blocks = 3, 16, 40
    lens = [1, block_size, 2 * block_size + 3, 5, 3 * block_size]  # ragged, exact multiples included
    k_cache = torch.full((num_blocks, block_size, H, D), float("nan"), dtype=dtype)  # unused slots are NaN
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()  # permuted, non-contiguous physical blocks
    tables, dense = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        ks, vs = torch.randn(n, H, D, generator=g).to(dtype), torch.randn(n, H, D, generator=g).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(ks, vs, k_cache, v_cache, slots)
        tables.append(table)
        dense.append((ks.float(), vs.float()))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    out = paged_attention(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), D**-0.5)
    assert out.dtype == dtype and not out.isnan().any()
    for b, (ks, vs) in enumerate(dense):
        ref = _dense(q[b].float(), ks, vs, D**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert torch.allclose(out[b].float(), ref, atol=tol), b


def _session(rid, prompt_len, generated):
    params = SamplingParams(max_tokens=100)
    s = InferenceSession(rid, None, list(range(1, prompt_len + 1)), params, params.make_generator(), None, 0, 512)
    s.output_ids = list(range(generated))
    return s


def test_slot_mapping_and_block_tables_on_hand_made_cases(engine):
    """(Stage 09: the metadata is built by the model runner from a SchedulerOutput, for the whole step.)"""
    bm = BlockSpaceManager(block_size=4, num_blocks=16)
    bm.free_block_ids.clear()
    bm.free_block_ids.extend([9, 2, 14, 5, 7, 0, 3])  # hand out blocks in a known, scrambled order
    runner = ModelRunner(engine.model, KVCache(engine.config, 16, 4, torch.float32, "cpu"), None, "cpu")
    a, b = _session("a", 6, 0), _session("b", 3, 0)

    def meta_for(*sessions):
        n = {s.request_id: s.num_tokens - s.num_computed_tokens for s in sessions}
        for s in sessions:
            assert bm.allocate_slots(s.request_id, n[s.request_id])
        meta = runner.prepare_inputs(SchedulerOutput(list(sessions), n, bm.block_tables)).attn_metadata
        for s in sessions:
            s.num_computed_tokens = s.num_tokens
        return meta

    meta = meta_for(a, b)  # both prompts in one step: a gets blocks 9, 2 and b block 14
    assert meta.slot_mapping.tolist() == [36, 37, 38, 39, 8, 9, 56, 57, 58]
    assert meta.query_start_loc.tolist() == [0, 6, 9] and meta.seq_lens.tolist() == [6, 3]
    # one decode step each: a feeds its 7th token (position 6), b its 4th (position 3)
    a.output_ids, b.output_ids = [11], [12]
    meta = meta_for(a, b)
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 14 * 4 + 3]
    assert meta.block_tables.tolist() == [[9, 2], [14, 0]]  # padded with 0, never read past seq_lens
    assert meta.seq_lens.tolist() == [7, 4] and meta.num_decodes == 2
    # b's next token needs a new block: it gets 5
    b.output_ids.append(13)
    a.output_ids.append(14)
    meta = meta_for(b, a)  # decode rows are ordered longest context first: a, then b
    assert meta.block_tables.tolist() == [[9, 2], [14, 5]]
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, 5 * 4 + 0]
    assert meta.seq_lens.tolist() == [8, 5]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    # a new request c (5 tokens) arrives while a decodes: c gets blocks 7, 0 and a's 9th token block 3;
    # in the batch the decode rows come first, then c's prompt
    c = _session("c", 5, 0)
    a.output_ids.append(15)
    meta = meta_for(c, a)
    assert meta.query_start_loc.tolist() == [0, 1, 6] and meta.num_decodes == 1
    assert meta.slot_mapping.tolist() == [3 * 4 + 0, 28, 29, 30, 31, 0 * 4 + 0]
    assert meta.block_tables.tolist() == [[9, 2, 3], [7, 0, 0]]


def test_engine_greedy_equals_hf_and_the_uncached_path(engine, hf_model):
    eng = LLMEngine(device="cpu", dtype="float32", block_size=8)
    naive = LLMEngine(device="cpu", dtype="float32")
    naive.model_runner.use_kv_cache = False
    greedy = SamplingParams(temperature=0, max_tokens=40)
    outs = {o.request_id: o.token_ids for o in eng.stream(PROMPTS, greedy) if o.finished}
    plain = {o.request_id: o.token_ids for o in naive.stream(PROMPTS, greedy) if o.finished}
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        assert outs[str(i)] == hf_greedy(hf_model, ids, 40), prompt
        assert outs[str(i)] == plain[str(i)], prompt
    assert eng.block_manager.stats().used_blocks == 0


def test_kv_lives_in_the_preallocated_pool():
    eng = LLMEngine(device="cpu", block_size=16, num_blocks=10)
    pool = eng.block_manager.kv_cache
    assert len(pool.layers) == eng.engine.config.n_layer
    assert pool.layers[0][0].shape == (10, 16, eng.engine.config.n_head, eng.engine.config.head_dim)
    before = pool.layers[0][0].clone()
    eng.add_request("a", "Romeo.\n", SamplingParams(temperature=0, max_tokens=4))
    eng.step()  # prefill writes the prompt's K/V into the request's block
    block = eng.block_manager.get_block_table("a")[0]
    assert not torch.equal(pool.layers[0][0][block], before[block])
    while eng.has_unfinished_requests():
        eng.step()
    assert "kv_cache" not in InferenceSession.__dataclass_fields__


def test_small_pool_forces_preemption_and_every_request_still_gets_its_solo_output():
    prompts = [list(range(1 + 10 * i, 9 + 10 * i)) for i in range(6)]  # 8 tokens each
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), SamplingParams(temperature=0.9, seed=3,
              top_k=30, max_tokens=30, ignore_eos=True)] * 3  # fmt: skip
    eng = LLMEngine(device="cpu", dtype="float32", block_size=4, num_blocks=14, max_num_seqs=6)
    eng.trace = []
    done = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(str(i), p, sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert eng.scheduler.num_preemptions > 0
    assert max(t["stats"].used_blocks for t in eng.trace) <= 14
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert done[str(i)] == list(eng.engine.token_stream(p, sp)), i
    assert eng.block_manager.stats().used_blocks == 0


def test_preempted_request_goes_to_the_front_of_waiting():
    eng = LLMEngine(device="cpu", block_size=4, num_blocks=6, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, list(range(1, 5)), p)  # 4 tokens = 1 full block each
    eng.add_request("d", [1, 2, 3, 4], p)
    eng.step()  # a, b, c, d prefilled: 4 blocks used, 2 free
    eng.step()  # each needs a 2nd block: a and b take the free ones, c preempts the youngest (d)
    assert eng.scheduler.num_preemptions == 1
    assert [s.request_id for s in eng.scheduler.waiting] == ["d"]
    assert [s.request_id for s in eng.scheduler.running] == ["a", "b", "c"]
    while eng.scheduler.num_preemptions == 1:
        eng.step()  # 4 tokens later a needs a 3rd block: c, now the youngest, is preempted
    assert [s.request_id for s in eng.scheduler.waiting] == ["c", "d"]  # the front of the queue, oldest first
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.stats().used_blocks == 0
