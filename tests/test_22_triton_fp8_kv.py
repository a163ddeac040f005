"""The Triton attention kernels over an fp8 KV cache (kv_cache_dtype="fp8": float8_e4m3fn pools, k_scale = 1).

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run on CPU tensors in Triton's interpreter.
Its fp8 -> fp32 conversion is exact, but its fp32 -> fp8 cast rounds wrongly (see roseinfer/attention/triton_fp8.py),
so the `interpreter_fp8_rounding` fixture swaps in torch's, the rounding the GPU's cvt.rn.satfinite does: the
write kernel's own part (its clamp, the addressing, the cast's target type) is what these tests check.

    write_kv into fp8 pools           == x.clamp(-448, 448).to(float8_e4m3fn) at each slot, bit for bit
    decode, split-K, prefill on fp8   == the same kernels on `pool.float()` (the fp8 values in fp32), bit for bit
                                      ~= the PyTorch references on those float pools, to fp32 rounding
    copy_blocks on fp8 pools          == the bytes of the src blocks

The `cuda` test runs the compiled kernels on a GPU (fp8 needs sm_89+), hardware rounding included.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from roseinfer.attention.reference import attention_reference, paged_attention_reference  # noqa: E402
from roseinfer.attention.triton_copy import copy_blocks_triton  # noqa: E402
from roseinfer.attention.triton_kernels import (  # noqa: E402
    paged_attention_triton,
    paged_attention_triton_split,
    write_kv_triton,
)
from roseinfer.attention.triton_prefill import attention_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def interpreter_fp8_rounding(monkeypatch):
    """Under the interpreter: fp32 -> fp8e4nv casts round to nearest even (torch's cast, as `cvt.rn.satfinite`
    on sm_89+), but a value past ±448 becomes NaN instead of saturating, as a cast that does not saturate would
    (the interpreter's own): so the kernel's clamp, not the cast, must keep the pool finite."""
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return torch.where(x.abs() > 448, torch.nan, x).to(FP8).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """What the main checkout's write stores (k_scale = 1): x saturated to e4m3's range, rounded to e4m3."""
    return x.clamp(-448, 448).to(FP8)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def kv_values(n: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n, Hkv, D] K or V with everything an e4m3 cast can meet: past ±448, exact ties between two fp8 values,
    subnormals, zeros of both signs; the rest normal(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hkv, d, generator=g) * 2
    special = [
        1000.0,
        -500.0,
        448.0,
        464.0,
        8.5,
        -9.5,
        17.0,
        0.0,
        -0.0,
        127.97,
        2.0**-8,
        -3 * 2.0**-9,
        3 * 2.0**-10,
        1e-9,
    ]
    # 8.5, -9.5, 17 and 3·2⁻¹⁰ (a subnormal) lie halfway between two fp8 values: ties go to the even one;
    # 464 lies halfway between 448 and 480, which e4m3fn does not have; 127.97 rounds up into the next binade
    x.view(-1)[: len(special)] = torch.tensor(special)
    return x.to(dtype).to(DEVICE)


def paged_pools(reqs, hkv, d, block_size, kv_dtype, seed=0):
    """Pools of `kv_dtype` and block tables for requests of these context lengths, every context token written by
    write_kv_triton in scrambled physical blocks; spare blocks hold stale fp8 values."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-s // block_size) for s in reqs]
    num_blocks = sum(n_blocks) + 2
    physical = torch.randperm(num_blocks, generator=g)
    k_cache = to_fp8(torch.randn(num_blocks, block_size, hkv, d, generator=g) * 50).to(DEVICE)  # stale
    v_cache = to_fp8(torch.randn(num_blocks, block_size, hkv, d, generator=g) * 50).to(DEVICE)
    if kv_dtype != FP8:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    tables = torch.zeros(len(reqs), max(n_blocks), dtype=torch.int32)
    slots, start = [], 0
    for b, s in enumerate(reqs):
        tables[b, : n_blocks[b]] = physical[start : start + n_blocks[b]].int()
        start += n_blocks[b]
        pos = torch.arange(s)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots).to(DEVICE)
    key = kv_values(len(slot_mapping), hkv, d, torch.float32, seed + 1)
    value = kv_values(len(slot_mapping), hkv, d, torch.float32, seed + 2)
    write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    return k_cache, v_cache, tables.to(DEVICE), key, value, slot_mapping


# ---- the write -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv_into_fp8_pools_saturates_and_rounds_as_torch(dtype):
    N, Hkv, D, bs = 5, 3, 16, 4  # Hkv = 3: a masked head row in the kernel's tile
    key, value = kv_values(N, Hkv, D, dtype, 1), kv_values(N, Hkv, D, dtype, 2)
    k_cache = torch.full((4, bs, Hkv, D), 7.0, device=DEVICE).to(FP8)
    v_cache = k_cache.clone()
    slots = torch.tensor([5, 0, -1, 15, 9], device=DEVICE)  # -1: a padding token, nothing written
    want_k, want_v = bits(k_cache).clone(), bits(v_cache).clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs], want_v[s // bs, s % bs] = bits(to_fp8(key[i])), bits(to_fp8(value[i]))
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(bits(k_cache), want_k) and torch.equal(bits(v_cache), want_v)
    assert k_cache.float().abs().max() == 448 and not k_cache.float().isnan().any()  # saturated, never NaN


def test_write_kv_into_a_float_pool_is_unchanged():
    """No clamp for float pools: a value past 448 is stored as it is."""
    key = torch.full((1, 1, 16), 1000.0, device=DEVICE)
    k_cache = torch.zeros(1, 4, 1, 16, device=DEVICE)
    write_kv_triton(key, -key, k_cache, k_cache.clone(), torch.tensor([2], device=DEVICE))
    assert (k_cache[0, 2] == 1000).all()


# ---- the reads: fp8 pools == their values in fp32 -------------------------------------------------------------
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_decode_on_fp8_pools_equals_the_float_pools(heads, q_dtype):
    H, Hkv = heads
    D, bs, reqs = 16, 4, [9, 1, 16]
    k8, v8, tables, *_ = paged_pools(reqs, Hkv, D, bs, FP8)
    kf, vf = k8.float(), v8.float()  # the fp8 values, exactly, in fp32
    q = (torch.randn(len(reqs), H, D, generator=torch.Generator().manual_seed(5)) * 0.1).to(q_dtype).to(DEVICE)
    lens = torch.tensor(reqs, dtype=torch.int32, device=DEVICE)
    scale = D**-0.5
    want = paged_attention_reference(q, kf, vf, tables, lens, scale)
    for run in (paged_attention_triton, lambda *a: paged_attention_triton_split(*a, num_splits=3)):
        got = run(q, k8, v8, tables, lens, scale)
        assert got.dtype == q_dtype and torch.equal(got, run(q, kf, vf, tables, lens, scale))
        tol = 1e-5 if q_dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_on_fp8_pools_equals_the_float_pools(q_dtype):
    """Two decodes, then a fresh prompt and a later chunk: the decode and the prefill kernel in one call."""
    H, Hkv, D, bs = 4, 2, 16, 8
    reqs = [(7, 1), (12, 1), (20, 20), (19, 6)]  # (seq_len, q_len)
    k8, v8, tables, *_ = paged_pools([s for s, _ in reqs], Hkv, D, bs, FP8, seed=3)
    kf, vf = k8.float(), v8.float()
    q_lens = [t for _, t in reqs]
    q = (torch.randn(sum(q_lens), H, D, generator=torch.Generator().manual_seed(6)) * 0.1).to(q_dtype).to(DEVICE)
    starts = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=DEVICE)
    args = (tables, starts, seq_lens, 2, max(q_lens), D**-0.5)
    got = attention_triton(q, k8, v8, *args)
    assert got.dtype == q_dtype and torch.equal(got, attention_triton(q, kf, vf, *args))
    want = attention_reference(q, kf, vf, tables, starts, seq_lens, D**-0.5)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_copy_blocks_moves_the_bytes_of_fp8_pools():
    pools = [tuple(to_fp8(torch.randn(5, 4, 2, 16, generator=torch.Generator().manual_seed(i)) * 30) for _ in "kv")
             for i in range(2)]  # fmt: skip
    pools = [(k.to(DEVICE), v.to(DEVICE)) for k, v in pools]
    want = [(bits(k).clone(), bits(v).clone()) for k, v in pools]
    mapping = torch.tensor([[0, 3], [0, 4], [2, 1]])
    for wk, wv in want:
        wk[mapping[:, 1]], wv[mapping[:, 1]] = wk[mapping[:, 0]], wv[mapping[:, 0]]
    copy_blocks_triton(pools, mapping)
    for (k, v), (wk, wv) in zip(pools, want, strict=True):
        assert torch.equal(bits(k), wk) and torch.equal(bits(v), wv)


# ---- CUDA only: the compiled kernels, the GPU's own fp8 rounding -------------------------------------------------
@pytest.mark.cuda
def test_fp8_kv_cache_on_cuda():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's fp8e4nv needs sm_89 or newer")
    H, Hkv, D, bs, reqs = 8, 2, 64, 16, [300, 1, 77]
    k8, v8, tables, key, value, slots = paged_pools(reqs, Hkv, D, bs, FP8)
    blocks, offs = slots // bs, slots % bs
    assert torch.equal(bits(k8)[blocks, offs], bits(to_fp8(key)))  # the GPU's own rounding == torch's
    assert torch.equal(bits(v8)[blocks, offs], bits(to_fp8(value)))
    for dtype in (torch.float16, torch.bfloat16):  # the model's K and V, converted on the GPU from fp16 / bf16
        x, pool = kv_values(32, Hkv, D, dtype, 9), torch.zeros(2, bs, Hkv, D, device="cuda").to(FP8)
        write_kv_triton(x, x, pool, pool.clone(), torch.arange(32, device="cuda"))
        assert torch.equal(bits(pool).view(32, Hkv, D), bits(to_fp8(x)))
    kf, vf = k8.float(), v8.float()
    q = torch.randn(len(reqs), H, D, device="cuda", dtype=torch.float16) * 0.1
    lens = torch.tensor(reqs, dtype=torch.int32, device="cuda")
    for run in (paged_attention_triton, paged_attention_triton_split):
        torch.testing.assert_close(run(q, k8, v8, tables, lens, D**-0.5), run(q, kf, vf, tables, lens, D**-0.5),
                                   atol=1e-3, rtol=1e-3)  # fmt: skip
    want = paged_attention_reference(q, kf, vf, tables, lens, D**-0.5)
    torch.testing.assert_close(paged_attention_triton(q, k8, v8, tables, lens, D**-0.5), want, atol=2e-3, rtol=2e-3)
    starts = torch.tensor([0, 300, 301, 378], dtype=torch.int32, device="cuda")
    qp = torch.randn(378, H, D, device="cuda", dtype=torch.float16) * 0.1
    args = (tables, starts, lens, 0, 300, D**-0.5)
    torch.testing.assert_close(attention_triton(qp, k8, v8, *args), attention_triton(qp, kf, vf, *args),
                               atol=2e-3, rtol=2e-3)  # fmt: skip
