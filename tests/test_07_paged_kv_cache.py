"""Stage 07: the paged KV pool, attention metadata, reference paged attention, preemption."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, core, hf_greedy

from roseinfer import LLMEngine, SamplingParams
from roseinfer.attention import paged_attention, write_kv
from roseinfer.core.request import Request
from roseinfer.core.sched.output import SchedulerOutput
from roseinfer.core.sched.runner_view import RunnerView


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


class _HandDriver:
    """Drives an engine's model runner without its scheduler: each step books the slots of the requests it is
    given in the engine's KV cache manager (in that order), tells the runner through a `RunnerView` what it
    lacks, and records the attention metadata of the step's forward."""

    def __init__(self, eng: LLMEngine, monkeypatch):
        self.kv, self.runner = core(eng).kv_cache_manager, core(eng).model_runner
        self.view = RunnerView(self.kv)
        self.reqs: dict[str, Request] = {}
        self.metas = []
        model, forward = self.runner.model, self.runner.model.forward_paged
        monkeypatch.setattr(model, "forward_paged", lambda *a: self.metas.append(a[3]) or forward(*a))

    def add(self, rid: str, prompt_len: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=100)
        self.reqs[rid] = Request(rid, list(range(1, prompt_len + 1)), params, None, 512)

    def step(self, *rids: str):
        """One step that computes everything each of `rids` lacks: all of a new prompt, one token of a decode."""
        so = SchedulerOutput()
        for rid in rids:
            req = self.reqs[rid]
            n = req.num_tokens - req.num_computed_tokens
            blocks = self.kv.allocate_slots(rid, n)
            assert blocks
            so.blocks_to_copy += blocks.copies
            self.view.record_blocks(rid, blocks)
            self.view.add_scheduled(req, n, so)
            req.num_computed_tokens += n
        out = self.runner.execute_model(so)
        assert sorted(out.req_ids) == sorted(rids)  # every request reached its end: one token each
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.reqs[rid].append_token(tokens[0])
        return self.metas[-1]


def test_slot_mapping_and_block_tables_on_hand_made_cases(monkeypatch):
    """(Stage 09: the metadata is built by the model runner for the whole step, from its persistent batch
    (roseinfer/worker/input_batch.py) and what the SchedulerOutput says changed.)"""
    eng = LLMEngine(device="cpu", dtype="float32", block_size=4, num_blocks=16)
    core(eng).kv_cache_manager.free_block_ids.clear()
    core(eng).kv_cache_manager.free_block_ids.extend(
        [9, 2, 14, 5, 7, 0, 3]
    )  # hand out blocks in a known, scrambled order
    d = _HandDriver(eng, monkeypatch)
    d.add("a", 6)
    d.add("b", 3)
    meta = d.step("a", "b")  # both prompts in one step: a gets blocks 9, 2 and b block 14
    assert meta.slot_mapping.tolist() == [36, 37, 38, 39, 8, 9, 56, 57, 58]
    assert meta.query_start_loc.tolist() == [0, 6, 9] and meta.seq_lens.tolist() == [6, 3]
    # one decode step each: a feeds its 7th token (position 6), b its 4th (position 3)
    meta = d.step("a", "b")
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 14 * 4 + 3]
    assert meta.block_tables.tolist() == [[9, 2], [14, 0]]  # padded with 0, never read past seq_lens
    assert meta.seq_lens.tolist() == [7, 4] and meta.num_decodes == 2
    # b's next token needs a new block: it gets 5
    meta = d.step("b", "a")  # decode rows are ordered longest context first: a, then b
    assert meta.block_tables.tolist() == [[9, 2], [14, 5]]
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, 5 * 4 + 0]
    assert meta.seq_lens.tolist() == [8, 5]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    # a new request c (5 tokens) arrives while a decodes: c gets blocks 7, 0 and a's 9th token block 3;
    # in the batch the decode rows come first, then c's prompt
    d.add("c", 5)
    meta = d.step("c", "a")
    assert meta.query_start_loc.tolist() == [0, 1, 6] and meta.num_decodes == 1
    assert meta.slot_mapping.tolist() == [3 * 4 + 0, 28, 29, 30, 31, 0 * 4 + 0]
    assert meta.block_tables.tolist() == [[9, 2, 3], [7, 0, 0]]


def _is_dense_greedy(model, prompt: list[int], out: list[int], max_tokens: int, eos: int) -> bool:
    """Whether `out` is what greedy decoding with no KV cache gives: one dense forward over prompt + out (causal,
    so each position's logits see only the tokens before it) must pick every token of `out` as its argmax, and
    `out` must stop where that loop stops (at EOS or after max_tokens)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0]  # [T, V]
    picks = logits[len(prompt) - 1 : len(prompt) + len(out) - 1].argmax(-1).tolist()
    stops = [i for i, t in enumerate(out) if t == eos]
    return picks == out and (stops == [len(out) - 1] or (not stops and len(out) == max_tokens))


def test_engine_greedy_equals_hf_and_the_uncached_path(tokenizer, hf_model):
    eng = LLMEngine(device="cpu", dtype="float32", block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    outs = {o.request_id: o.token_ids for o in eng.stream(PROMPTS, greedy) if o.finished}
    model, eos = core(eng).model_runner.model, eng.config.model_config.eos_token_id
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        assert outs[str(i)] == hf_greedy(hf_model, ids, 40), prompt
        assert _is_dense_greedy(model, ids, outs[str(i)], 40, eos), prompt
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_kv_lives_in_the_preallocated_pool():
    eng = LLMEngine(device="cpu", block_size=16, num_blocks=10)
    pool, hf = core(eng).model_runner.kv_cache, eng.config.model_config.hf_config
    assert len(pool.layers) == hf.n_layer
    assert pool.layers[0][0].shape == (10, 16, hf.n_head, hf.head_dim)
    k0, before = pool.layers[0][0], pool.layers[0][0].clone()
    eng.add_request("a", "Romeo.\n", SamplingParams(temperature=0, max_tokens=4))
    eng.step()  # prefill writes the prompt's K/V into the request's block
    block = core(eng).kv_cache_manager.get_block_table("a")[0]
    assert not torch.equal(pool.layers[0][0][block], before[block])
    # the request and the block books hold ids and counters, never a tensor: the K/V are only in the pool
    req = core(eng).scheduler.requests["a"]
    assert not any(isinstance(getattr(req, name), torch.Tensor) for name in Request.__slots__)
    assert not any(isinstance(v, torch.Tensor) for v in vars(core(eng).kv_cache_manager).values())
    while eng.has_unfinished_requests():
        eng.step()
    assert core(eng).model_runner.kv_cache.layers[0][0] is k0  # the same tensor all along: never reallocated


def test_small_pool_forces_preemption_and_every_request_still_gets_its_solo_output(llm):
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
    assert core(eng).scheduler.num_preemptions > 0
    assert max(t["stats"].used_blocks for t in eng.trace) <= 14
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert done[str(i)] == llm.generate([p], sp, use_tqdm=False)[0].token_ids, i  # alone, in another engine
    assert core(eng).kv_cache_manager.stats().used_blocks == 0


def test_preempted_request_goes_to_the_front_of_waiting():
    eng = LLMEngine(device="cpu", block_size=4, num_blocks=6, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, list(range(1, 5)), p)  # 4 tokens = 1 full block each
    eng.add_request("d", [1, 2, 3, 4], p)
    eng.step()  # a, b, c, d prefilled: 4 blocks used, 2 free
    eng.step()  # each needs a 2nd block: a and b take the free ones, c preempts the youngest (d)
    assert core(eng).scheduler.num_preemptions == 1
    assert [s.request_id for s in core(eng).scheduler.waiting] == ["d"]
    assert [s.request_id for s in core(eng).scheduler.running] == ["a", "b", "c"]
    while core(eng).scheduler.num_preemptions == 1:
        eng.step()  # 4 tokens later a needs a 3rd block: c, now the youngest, is preempted
    assert [s.request_id for s in core(eng).scheduler.waiting] == ["c", "d"]  # the front of the queue, oldest first
    while eng.has_unfinished_requests():
        eng.step()
    assert core(eng).kv_cache_manager.stats().used_blocks == 0
