"""Stage 22: the 8-bit KV cache (`kv_cache_dtype="fp8"`, roseinfer/attention/fp8_kv.py).

Every attention path reads an fp8 pool as the same path reads a float pool holding the same (rounded) values:
the C++ kernels bit for bit, the SDPA paths to fp32 rounding. The engine counts 4x the blocks of fp32 in the
same memory, and swap, prefix caching, n > 1 and batching keep their invariants."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_12_swap_preemption as t12
import torch
from conftest import core

from roseinfer import LLM, SamplingParams
from roseinfer.attention import get_backend
from roseinfer.attention.fp8_kv import FP8_DTYPE, pick_kv_cache_dtype
from roseinfer.attention.reference import paged_attention_reference, write_kv_reference
from roseinfer.attention.sdpa import attend_cascade, paged_decode_sdpa, plan_sdpa, write_kv_flat
from roseinfer.custom_ops import available as cpu_ops_available

LLAMA = "roseinfer/models/tiny-llama-shakespeare"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["ROMEO:", "To be, or not to be", "First Citizen:\nBefore we proceed", "KING.", "O Romeo, Romeo!"]
needs_cpp = pytest.mark.skipif(not cpu_ops_available(), reason="roseinfer's C++ ops could not be built")


def pools(num_blocks=24, block_size=16, hkv=3, d=64, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_blocks, block_size, hkv, d, generator=g) * scale).to(FP8_DTYPE)
    v = (torch.randn(num_blocks, block_size, hkv, d, generator=g) * scale).to(FP8_DTYPE)
    return k, v


# ---- the flag ---------------------------------------------------------------------------------------------
def test_kv_cache_dtype_names():
    assert pick_kv_cache_dtype("auto") is None
    assert pick_kv_cache_dtype("fp8") is pick_kv_cache_dtype("fp8_e4m3") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'int4'"):
        LLM(LLAMA, kv_cache_dtype="int4")
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        LLM(LLAMA, kv_cache_dtype=torch.float8_e4m3fn)


# ---- writes -----------------------------------------------------------------------------------------------
def test_both_writes_store_the_same_saturated_bytes():
    key = torch.randn(7, 3, 8) * 200  # beyond e4m3's ±448 in places
    key[0, 0, :2] = torch.tensor([1000.0, -1000.0])
    value = torch.randn(7, 3, 8)
    slots = torch.tensor([0, 5, 9, 16, 17, 40, 63])
    a, b = ([torch.zeros(4, 16, 3, 8, dtype=FP8_DTYPE) for _ in range(2)] for _ in range(2))
    write_kv_flat(key, value, *a, slots)
    write_kv_reference(key, value, *b, slots)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    flat = a[0].view(-1, 3, 8).float()
    assert flat[0, 0, :2].tolist() == [448.0, -448.0]  # saturated, not NaN
    assert torch.equal(flat[slots], key.to(FP8_DTYPE).float())


# ---- reads: the C++ kernels -------------------------------------------------------------------------------
@needs_cpp
def test_cpp_kernel_converts_every_fp8_value_exactly():
    """One token: the output is its V row. Every byte but e4m3's two NaNs, subnormals included."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F].view(FP8_DTYPE)  # [254]
    d = 64
    v = torch.zeros(4, 1, 1, d, dtype=FP8_DTYPE)
    v.view(-1)[: len(values)] = values
    k = torch.zeros_like(v)
    q = torch.randn(4, 1, d)
    out = torch.ops.roseinfer.paged_decode(q, k, v, torch.arange(4, dtype=torch.int32)[:, None],
                                           torch.ones(4, dtype=torch.int32), 0.125)  # fmt: skip
    assert torch.equal(out.view(-1)[: len(values)], values.float())


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40])
def test_cpp_kernels_read_fp8_pools_as_float_pools_of_the_same_values(dtype, d):
    k, v = pools(d=d)
    kf, vf = k.to(dtype), v.to(dtype)  # exact: every e4m3 value is a bf16 value
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:20].reshape(4, 5).int()
    lens = torch.tensor([1, 17, 80, 64], dtype=torch.int32)
    q = torch.randn(4, 9, d).to(dtype)
    out = torch.ops.roseinfer.paged_decode(q, k, v, tables, lens, 0.125)
    assert torch.equal(out, torch.ops.roseinfer.paged_decode(q, kf, vf, tables, lens, 0.125))
    ref = paged_attention_reference(q.float(), k.float(), v.float(), tables, lens, 0.125)
    torch.testing.assert_close(out.float(), ref, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    qc = torch.randn(20, 9, d).to(dtype)
    chunk = torch.ops.roseinfer.paged_prefill(qc, k, v, tables[2], 80, 0.125)
    assert torch.equal(chunk, torch.ops.roseinfer.paged_prefill(qc, kf, vf, tables[2], 80, 0.125))


# ---- reads: the SDPA paths --------------------------------------------------------------------------------
def test_sdpa_decode_and_cascade_read_fp8_pools():
    k, v = pools()
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(2))[:20].reshape(4, 5)
    lens = torch.tensor([3, 17, 80, 64])
    q = torch.randn(4, 9, 64)
    out = paged_decode_sdpa(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, paged_decode_sdpa(q, k.float(), v.float(), tables, lens, 0.125))
    shared = tables.clone()
    shared[:, :4] = tables[0, :4]  # every row starts with the same 4 blocks: cascade attention
    lens = [80, 70, 75, 66]
    meta = SimpleNamespace(block_tables=shared, seq_lens=torch.tensor(lens), seq_lens_cpu=lens, num_decodes=4,
                           query_start_loc_cpu=[0, 1, 2, 3, 4])  # fmt: skip
    plan = plan_sdpa(meta, 16, gather_decodes=False)
    assert plan.prefix_blocks is not None and len(plan.prefix_blocks) == 4
    a = attend_cascade(q, k, v, plan, 0.125, None)
    torch.testing.assert_close(a, attend_cascade(q, k.float(), v.float(), plan, 0.125, None))


# ---- the engine -------------------------------------------------------------------------------------------
def prefix(a: list[int], b: list[int]) -> int:
    """Tokens equal from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("model", [LLAMA, "roseinfer/models/tiny-shakespeare"])
def test_the_same_memory_holds_four_times_the_blocks(model):
    counts = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, device="cpu", dtype="float32", kv_cache_dtype=kv, kv_cache_memory=16 * 2**20)
        counts[kv] = llm.llm_engine.config.cache_config.num_gpu_blocks
        assert core(llm.llm_engine).kv_cache_manager.num_blocks == counts[kv]
        pool = core(llm.llm_engine).model_runner.kv_cache
        assert pool.layers[0][0].dtype == (FP8_DTYPE if kv == "fp8" else torch.float32)
    assert counts["fp8"] == 4 * counts["auto"]


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "torch"])
def test_fp8_cache_batched_equals_alone_and_follows_fp32(backend):
    llm = LLM(LLAMA, device="cpu", dtype="float32", attention_backend=backend, kv_cache_dtype="fp8")
    together = ids(llm)
    assert together == [ids(llm, [p])[0] for p in PROMPTS]
    fp32 = ids(LLM(LLAMA, device="cpu", dtype="float32", attention_backend=backend))
    same_start = [prefix(x, y) for x, y in zip(together, fp32, strict=True)]
    assert sum(same_start) >= len(PROMPTS) * GREEDY.max_tokens // 2, same_start  # the rounding may flip a late token


def test_fp8_cache_through_swap_prefix_caching_and_n():
    base = ids(LLM(LLAMA, device="cpu", dtype="float32", kv_cache_dtype="fp8"))
    for mode in ("swap", "recompute"):
        llm = LLM(LLAMA, device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=t12.BS, num_blocks=10,
                  max_num_seqs=5, preemption_mode=mode, swap_space=0.01)  # fmt: skip
        assert ids(llm) == base, mode
        t12.assert_no_leak(llm)
    llm = LLM(LLAMA, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    long = "First Citizen:\nBefore we proceed any further, hear me speak. " * 3
    first = llm.generate([long], GREEDY, use_tqdm=False)[0]
    again = llm.generate([long], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    two = llm.generate([long], SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in two[0].outputs] == [first.outputs[0].token_ids] * 2


def test_fp8_pool_through_get_backend_write():
    """The backends' own write (what the model calls) fills an fp8 pool."""
    for name in ("cpu", "sdpa", "torch"):
        backend = get_backend(name, torch.device("cpu"))
        k, v = torch.zeros(2, 16, 3, 8, dtype=FP8_DTYPE), torch.zeros(2, 16, 3, 8, dtype=FP8_DTYPE)
        key, value = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
        backend.write_kv(key, value, k, v, torch.tensor([1, 2, 20]))
        assert torch.equal(k.view(-1, 3, 8)[[1, 2, 20]].float(), key.to(FP8_DTYPE).float()), name
