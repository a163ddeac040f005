"""Stage 08: the Triton kernels equal the PyTorch reference, and the reference equals dense attention.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton, so these
run on CPU through Triton's interpreter. On a CUDA machine they run the compiled kernels on the GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import core, make_random_checkpoint

pytest.importorskip("triton")

from roseinfer.attention.reference import paged_attention_reference, write_kv_reference  # noqa: E402
from roseinfer.attention.triton_kernels import (  # noqa: E402
    paged_attention_triton,
    paged_attention_triton_split,
    write_kv_triton,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_paged_kv(context_lens, H, D, block_size, dtype, seed=0, write=write_kv_reference):
    """Random per-sequence K/V, written into a shuffled paged pool. Returns (dense_k, dense_v, pool...).

    Every slot that no sequence owns is NaN, and unused block-table entries point at an all-NaN
    block: a kernel that reads past a sequence's end (or through a stale table entry) returns NaN.
    """
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(n_blocks) + 2  # two spare blocks stay NaN
    max_blocks = max(n_blocks) + 1  # one extra table column, never used
    physical = torch.randperm(num_blocks, generator=g)  # hand out blocks in a scrambled order
    poison = physical[-1].item()  # an unowned block: all NaN
    block_tables = torch.full((len(context_lens), max_blocks), poison, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, H, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))

    dense_k, dense_v, slots = [], [], []
    next_block = 0
    for b, n in enumerate(context_lens):
        block_tables[b, : n_blocks[b]] = physical[next_block : next_block + n_blocks[b]].int()
        next_block += n_blocks[b]
        pos = torch.arange(n)
        slots.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)  # [n]
        dense_k.append(torch.randn(n, H, D, generator=g).to(dtype))  # [n, H, D]
        dense_v.append(torch.randn(n, H, D, generator=g).to(dtype))
    k_cache, v_cache, block_tables = k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)
    dense_k = [k.to(DEVICE) for k in dense_k]
    dense_v = [v.to(DEVICE) for v in dense_v]
    write(torch.cat(dense_k), torch.cat(dense_v), k_cache, v_cache, torch.cat(slots).to(DEVICE))
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return dense_k, dense_v, k_cache, v_cache, block_tables, context_lens


def dense_attention(q, dense_k, dense_v, scale):
    """Plain attention of q [B, H, D] over each sequence's contiguous K/V, in fp32, one sequence at a time."""
    outs = []
    for b in range(q.shape[0]):
        qb = q[b].float()[:, None, :]  # [H, 1, D]
        kb = dense_k[b].float().transpose(0, 1)  # [H, n, D]
        vb = dense_v[b].float().transpose(0, 1)  # [H, n, D]
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, scale=scale)[:, 0])  # [H, D]
    return torch.stack(outs)  # [B, H, D] fp32


def lens_for(block_size):
    """Ragged lengths: a single token, exact multiples of the block size, partial last blocks."""
    return [1, block_size, 2 * block_size + 3, 3 * block_size, 5]


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# The reference against dense attention (pure PyTorch, fast)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_matches_dense_attention(block_size, dtype):
    H, D = 3, 32
    lens = lens_for(block_size)
    dense_k, dense_v, k_cache, v_cache, tables, ctx = make_paged_kv(lens, H, D, block_size, dtype, seed=block_size)
    q = randn(len(lens), H, D, dtype=dtype, seed=1)
    out = paged_attention_reference(q, k_cache, v_cache, tables, ctx, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), dense_attention(q, dense_k, dense_v, D**-0.5), atol=ATOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------------
# KV write kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key_dtype, cache_dtype, slot_dtype, fused_qkv",
    [
        (torch.float32, torch.float32, torch.int64, False),
        (torch.float16, torch.float16, torch.int32, True),
        (torch.bfloat16, torch.bfloat16, torch.int64, True),
        (torch.float32, torch.float16, torch.int32, False),  # the store casts to the cache dtype
    ],
)
def test_write_kv_matches_reference(key_dtype, cache_dtype, slot_dtype, fused_qkv):
    N, H, D, block_size, num_blocks = 7, 3, 16, 8, 4  # H = 3: the head tile is padded to 4 and masked
    if fused_qkv:  # key/value as views into one [N, 3, H, D] projection: token stride is 3 * H * D
        qkv = randn(N, 3, H, D, dtype=key_dtype, seed=0)
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key, value = randn(N, H, D, dtype=key_dtype, seed=0), randn(N, H, D, dtype=key_dtype, seed=1)
    slots = torch.tensor([9, -1, 0, 31, 17, -1, 12], dtype=slot_dtype, device=DEVICE)  # -1 = padding
    k_ref = randn(num_blocks, block_size, H, D, dtype=cache_dtype, seed=2)
    v_ref = randn(num_blocks, block_size, H, D, dtype=cache_dtype, seed=3)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()

    write_kv_reference(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)  # a copy is exact; untouched slots unchanged
    assert torch.equal(k_tri[31 // block_size, 31 % block_size], key[3].to(cache_dtype))


# ---------------------------------------------------------------------------------------------
# Paged decode attention (v1: one program per sequence and head)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, H, D, dtype",
    [
        (8, 2, 32, torch.float32),
        (16, 2, 32, torch.float32),
        (32, 2, 32, torch.float32),
        (16, 3, 16, torch.float32),
        (16, 1, 64, torch.float32),
        (8, 2, 32, torch.float16),
        (16, 2, 32, torch.float16),
        (32, 2, 16, torch.bfloat16),
        (16, 2, 32, torch.bfloat16),
    ],
)
def test_paged_attention_triton_matches_reference(block_size, H, D, dtype):
    lens = lens_for(block_size)
    _, _, k_cache, v_cache, tables, ctx = make_paged_kv(lens, H, D, block_size, dtype, seed=D + block_size)
    q = randn(len(lens), H, D, dtype=dtype, seed=7)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, ctx, D**-0.5)
    out = paged_attention_triton(q, k_cache, v_cache, tables, ctx, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=0)


def test_paged_attention_triton_strided_q_and_out_buffer():
    """q as a view into a fused QKV tensor (batch stride 3 * H * D), output written into a given buffer."""
    block_size, H, D, lens = 8, 2, 16, [3, 17, 8]
    _, _, k_cache, v_cache, tables, ctx = make_paged_kv(lens, H, D, block_size, torch.float32, seed=5)
    q = randn(len(lens), 3, H, D, dtype=torch.float32, seed=6)[:, 0]  # [B, H, D], not contiguous
    out = torch.zeros(len(lens), H, D, device=DEVICE)
    result = paged_attention_triton(q, k_cache, v_cache, tables, ctx, D**-0.5, out=out)
    assert result is out
    expected = paged_attention_reference(q, k_cache, v_cache, tables, ctx, D**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_triton_write_then_attend_matches_dense_attention():
    """End to end with both kernels: write a NaN-filled pool with Triton, attend with Triton, compare to SDPA."""
    block_size, H, D, lens = 16, 2, 32, [1, 16, 35]
    dense_k, dense_v, k_cache, v_cache, tables, ctx = make_paged_kv(
        lens, H, D, block_size, torch.float16, seed=11, write=write_kv_triton
    )
    q = randn(len(lens), H, D, dtype=torch.float16, seed=12)
    out = paged_attention_triton(q, k_cache, v_cache, tables, ctx, D**-0.5)
    torch.testing.assert_close(out.float(), dense_attention(q, dense_k, dense_v, D**-0.5), atol=2e-3, rtol=0)


# ---------------------------------------------------------------------------------------------
# Split-K (flash-decoding) variant
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_splits, block_size, dtype",
    [
        (1, 8, torch.float32),
        (2, 8, torch.float32),
        (3, 8, torch.float32),  # not a power of two: the reduce masks the padded split
        (8, 8, torch.float32),  # more splits than blocks: most splits are empty
        (4, 16, torch.float16),
        (2, 32, torch.bfloat16),
    ],
)
def test_paged_attention_split_matches_reference(num_splits, block_size, dtype):
    H, D = 2, 32
    lens = lens_for(block_size)
    _, _, k_cache, v_cache, tables, ctx = make_paged_kv(lens, H, D, block_size, dtype, seed=num_splits)
    q = randn(len(lens), H, D, dtype=dtype, seed=9)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, ctx, D**-0.5)
    out = paged_attention_triton_split(q, k_cache, v_cache, tables, ctx, D**-0.5, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------------
# Bad arguments fail loudly
# ---------------------------------------------------------------------------------------------


def test_rejects_non_power_of_two_block_size_and_head_dim():
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 12, 2, 16, device=DEVICE)  # block_size 12
    with pytest.raises(AssertionError, match="block_size"):
        paged_attention_triton(q, cache, cache, tables, ctx, 0.25)
    q, cache = torch.zeros(1, 2, 24, device=DEVICE), torch.zeros(2, 8, 2, 24, device=DEVICE)  # head_dim 24
    with pytest.raises(AssertionError, match="head_dim"):
        paged_attention_triton(q, cache, cache, tables, ctx, 0.25)


def test_end_to_end_greedy_decode_through_the_triton_backend(tmp_path):
    """A tiny random GPT-2 (head_dim 16) decodes the same tokens with the triton and torch backends."""
    from roseinfer import LLMEngine, SamplingParams

    model_dir = make_random_checkpoint(tmp_path / "m", seed=1, n_embd=32, n_head=2, n_layer=2, n_positions=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(
            model_dir, device=DEVICE, dtype="float32", block_size=8, num_blocks=8, attention_backend=backend
        )
        assert core(eng).model_runner.backend.name == backend
        outs[backend] = [o.token_ids for o in eng.stream([[5, 6, 7], list(range(10, 21))], params) if o.finished]
    assert outs["triton"] == outs["torch"] and len(outs["torch"][0]) == 6


def test_backend_choice():
    from roseinfer.attention import get_backend

    assert get_backend("auto", "cpu").name == "cpu"  # stage 17: sdpa with an in-place decode kernel
    assert get_backend("torch", "cpu").name == "torch"
    assert get_backend("sdpa", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention_backend"):
        get_backend("flash", "cpu")
    if torch.cuda.is_available():
        assert get_backend("auto", "cuda").name == "triton"


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    from roseinfer.attention import get_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        get_backend("triton", "cpu")


# ---- on a GPU (skipped without CUDA) ------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernel_matches_reference_at_model_sizes(D, dtype):
    lens = [1, 17, 300, 1024, 2047]
    _, _, k_cache, v_cache, block_tables, ctx = make_paged_kv(lens, 12, D, 16, dtype, write=write_kv_triton)
    q = torch.randn(len(lens), 12, D, device="cuda", dtype=dtype)
    ref = paged_attention_reference(q, k_cache, v_cache, block_tables, ctx, D**-0.5)
    from roseinfer.attention.triton_kernels import paged_attention_auto

    for fn in (paged_attention_triton, paged_attention_auto):
        out = fn(q, k_cache, v_cache, block_tables, ctx, D**-0.5)
        assert torch.allclose(out.float(), ref.float(), atol=ATOL[dtype] * 5)


@pytest.mark.cuda
def test_cuda_end_to_end_greedy_triton_equals_torch_equals_hf(hf_model):
    from conftest import PROMPTS, hf_greedy

    from roseinfer import LLMEngine, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(device="cuda", dtype="float32", attention_backend=backend)
        outs[backend] = {o.request_id: o.token_ids for o in eng.stream(PROMPTS, params) if o.finished}
    assert outs["triton"] == outs["torch"]
    tok = eng.tokenizer
    for i, prompt in enumerate(PROMPTS):
        assert outs["triton"][str(i)] == hf_greedy(hf_model, tok.encode(prompt), 48), prompt


def test_benchmark_decode_roofline_arithmetic():
    from benchmarks import benchmark as bench

    wl = bench.Workload({}, [[1] * 10, [1] * 20], [4, 2])
    cfg = {"n_embd": 8, "n_layer": 2, "vocab_size": 100, "n_positions": 32}
    rf = bench.decode_roofline(wl, cfg, torch.float16, batch_size=2, bandwidth=1e9)
    assert rf["weight_bytes"] == (100 * 8 + 32 * 8 + 2 * (12 * 64 + 13 * 8) + 16) * 2
    kv_per_token = 2 * 2 * 8 * 2
    assert rf["kv_bytes"] == kv_per_token * ((10 + 11 + 12 + 13) + (20 + 21))  # every context read once
    assert rf["min_decode_steps"] == 3  # 6 tokens, 2 per step
    assert rf["seconds"] == pytest.approx((3 * rf["weight_bytes"] + rf["kv_bytes"]) / 1e9)
