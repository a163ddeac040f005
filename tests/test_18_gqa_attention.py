"""Grouped-query attention (GQA) through every attention backend.

H query heads share Hkv <= H K/V heads (H % Hkv == 0): query head h reads K/V head h // G, G = H // Hkv
(Hugging Face's `repeat_kv`). The pools are [num_blocks, block_size, Hkv, D], the new tokens' key/value
[N, Hkv, D], q and the output [N, H, D]. Hkv == H is MHA, Hkv == 1 MQA.

Every backend is checked against `dense_attention` below, built independently of roseinfer: each request's
K/V repeated to H heads, plain causal softmax attention in fp64. The batches are mixed as the engine sends
them (decodes first, then later prefill chunks with context, then first chunks), over blocks handed out
in a scrambled order, with finite garbage in every slot no request owns. Without CUDA, tests/conftest.py
sets TRITON_INTERPRET=1, so the Triton kernels run in Triton's CPU interpreter: their shapes stay tiny.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from roseinfer.attention import AttentionMetadata, get_backend
from roseinfer.attention.reference import attention_reference, paged_attention_reference, write_kv_reference
from roseinfer.attention.sdpa import SdpaPlan, plan_sdpa

HEADS = [(4, 4), (4, 2), (4, 1), (9, 3), (8, 2)]  # (H, Hkv): MHA, G = 2, MQA, G = 3 (odd counts), G = 4
SIZES = [(32, 1), (32, 16), (64, 4), (64, 16), (80, 4)]  # (D, block_size): every head size and block size
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
HAS_TRITON = bool(__import__("importlib").util.find_spec("triton"))
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def _cpu_kernel_builds() -> bool:
    from roseinfer.attention.cpu_paged import load_kernel

    return load_kernel()


# ---------------------------------------------------------------------------------------------------------
# A mixed batch over a scrambled paged pool, and the dense oracle
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    q: torch.Tensor  # [N, H, D]
    key: torch.Tensor  # [N, Hkv, D] the new tokens' K/V (not yet in the pool)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], the context before this step written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per request [seq_len, Hkv, D], the whole context (new tokens included)
    dense_v: list[torch.Tensor]
    reqs: list[tuple[int, int]]  # (seq_len, q_len)
    scale: float


def mixed_reqs(bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len): decodes (1 token, block boundaries, partial blocks), later chunks, first chunks."""
    decodes = [(1, 1), (bs, 1), (2 * bs + 3, 1), (3 * bs, 1), (5 * bs + 1, 1)]
    later = [(2 * bs + 5, 7), (3 * bs, bs), (bs + 1, 1 + bs // 2)]  # the last: a 1-token chunk when bs = 1
    first = [(9, 9), (bs + 2, bs + 2)]
    return decodes + later + first


def make_batch(reqs, H, Hkv, D, bs, dtype=torch.float32, seed=0, shared_blocks=0) -> Batch:
    """The pool holds every request's context except this step's new tokens (the backend writes those).
    `shared_blocks` > 0: every decode row starts with the same physical blocks, holding the same K/V
    (a cached prefix, as prefix caching makes it), so the sdpa backend takes its cascade path."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(n / bs) for n, _ in reqs]
    num_decodes = next((b for b, (_, t) in enumerate(reqs) if t != 1), len(reqs))  # the leading q_len == 1 rows
    own = [nb - (shared_blocks if b < num_decodes else 0) for b, nb in enumerate(n_blocks)]
    num_blocks = shared_blocks + sum(own) + 3  # three spare blocks nobody owns
    physical = torch.randperm(num_blocks, generator=g).tolist()
    prefix, poison = physical[:shared_blocks], physical[-1]
    free = iter(physical[shared_blocks:-1])
    width = max(n_blocks) + 1  # one extra table column, never used
    tables = torch.full((len(reqs), width), poison, dtype=torch.int32)
    # garbage in every unowned slot: finite (the sdpa path relies on it) and large (a read of it shows)
    k_cache = (torch.randn(num_blocks, bs, Hkv, D, generator=g) * 100).to(dtype)
    v_cache = (torch.randn(num_blocks, bs, Hkv, D, generator=g) * 100).to(dtype)
    prefix_k = torch.randn(shared_blocks * bs, Hkv, D, generator=g).to(dtype)
    prefix_v = torch.randn(shared_blocks * bs, Hkv, D, generator=g).to(dtype)
    dense_k, dense_v, old_slots, new_slots = [], [], [], []
    for b, (n, t) in enumerate(reqs):
        shared = shared_blocks if b < num_decodes else 0
        table = prefix[:shared] + [next(free) for _ in range(n_blocks[b] - shared)]
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, Hkv, D, generator=g).to(dtype)  # [n, Hkv, D]
        v = torch.randn(n, Hkv, D, generator=g).to(dtype)
        if shared:  # the cached prefix's K/V, the same in every decode row
            k[: shared * bs], v[: shared * bs] = prefix_k, prefix_v
        dense_k.append(k)
        dense_v.append(v)
        pos = torch.arange(n)
        slots = tables[b, pos // bs].long() * bs + pos % bs  # [n]
        old_slots.append(slots[: n - t])
        new_slots.append(slots[n - t :])
    old_k = torch.cat([k[: n - t] for k, (n, t) in zip(dense_k, reqs, strict=True)])
    old_v = torch.cat([v[: n - t] for v, (n, t) in zip(dense_v, reqs, strict=True)])
    write_kv_reference(old_k, old_v, k_cache, v_cache, torch.cat(old_slots))
    key = torch.cat([k[n - t :] for k, (n, t) in zip(dense_k, reqs, strict=True)])  # [N, Hkv, D]
    value = torch.cat([v[n - t :] for v, (n, t) in zip(dense_v, reqs, strict=True)])
    starts = [0]
    for _, t in reqs:
        starts.append(starts[-1] + t)
    seq_lens = [n for n, _ in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, num_decodes=num_decodes,
        max_query_len=max(t for _, t in reqs), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    q = torch.randn(starts[-1], H, D, generator=g).to(dtype)
    return Batch(q, key, value, k_cache, v_cache, meta, dense_k, dense_v, reqs, D**-0.5)


def dense_attention(batch: Batch) -> torch.Tensor:  # [N, H, D] fp64
    """Each request on its own: K/V repeated to H heads (head h gets K/V head h // G), causal softmax in fp64."""
    H = batch.q.shape[1]
    out, start = [], 0
    for k, v, (n, t) in zip(batch.dense_k, batch.dense_v, batch.reqs, strict=True):
        G = H // k.shape[1]
        k = k.double().repeat_interleave(G, dim=1)  # [n, H, D]
        v = v.double().repeat_interleave(G, dim=1)
        q = batch.q[start : start + t].double()  # [t, H, D]
        scores = torch.einsum("thd,nhd->htn", q, k) * batch.scale  # [H, t, n]
        visible = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]  # [t, n]: query i at n - t + i
        p = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("htn,nhd->thd", p, v))
        start += t
    return torch.cat(out)


def run_backend(name: str, batch: Batch) -> torch.Tensor:
    """A layer's attention as the model runner calls it: write_kv, the step's plan, then forward."""
    backend = get_backend(name, "cpu")
    meta = batch.meta
    meta.backend, meta.plan = backend, None
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping)
    if backend.prepare is not None:
        meta.plan = backend.prepare(meta, k_cache.shape[1])
    return backend.forward(batch.q, batch.key, batch.value, k_cache, v_cache, meta, batch.scale)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected.double(), atol=TOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------------------------
# The reference, and the CPU backends, on mixed batches
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("D", "block_size"), SIZES)
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
def test_the_reference_equals_dense_attention(H, Hkv, D, block_size):
    batch = make_batch(mixed_reqs(block_size), H, Hkv, D, block_size, seed=H * Hkv + D + block_size)
    k_cache, v_cache, meta = batch.k_cache, batch.v_cache, batch.meta
    write_kv_reference(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping)
    expected = dense_attention(batch)
    out = attention_reference(batch.q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                              batch.scale)  # fmt: skip
    assert_close(out, expected, torch.float32)
    d = meta.num_decodes  # the batched decode reference on the decode rows
    dec = paged_attention_reference(batch.q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d],
                                    batch.scale)  # fmt: skip
    assert_close(dec, expected[:d], torch.float32)


CPU_BACKENDS = ["torch", "sdpa", pytest.param("cpu", marks=pytest.mark.skipif("not _cpu_kernel_builds()"))]


@pytest.mark.parametrize(("D", "block_size"), SIZES)
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_equal_dense_attention_on_mixed_batches(backend, H, Hkv, D, block_size):
    batch = make_batch(mixed_reqs(block_size), H, Hkv, D, block_size, seed=7 * H + Hkv + D + block_size)
    assert_close(run_backend(backend, batch), dense_attention(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
@pytest.mark.parametrize("backend", ["sdpa", pytest.param("cpu", marks=pytest.mark.skipif("not _cpu_kernel_builds()"))])
def test_cascade_attention_with_gqa(backend, H, Hkv, dtype):
    """Decode rows behind a shared cached prefix: the prefix is attended once for all rows (with G query rows
    per K/V head), each row's own tokens apart, the two merged by their log-sum-exps."""
    bs, shared = 4, 5  # 5 shared blocks: at least CASCADE_MIN_BLOCKS
    reqs = [(shared * bs + n, 1) for n in (13, 9, 5, 1, 2, 7)] + [(2 * bs + 3, 3), (6, 6)]
    batch = make_batch(reqs, H, Hkv, 32, bs, dtype, seed=H + Hkv, shared_blocks=shared)
    out = run_backend(backend, batch)
    plan = batch.meta.plan
    assert isinstance(plan, SdpaPlan) and plan.prefix_blocks is not None and len(plan.prefix_blocks) == shared
    assert_close(out, dense_attention(batch).to(dtype), dtype)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mha_through_sdpa_is_bit_identical_to_plain_sdpa_calls(block_size):
    """Hkv == H: the folded G = 1 views are the MHA calls of before, to the bit: the decode runs as
    SDPA(q[:, :, None]) over the gathered [B, H, L, D] blocks, each chunk as SDPA over [H, T|L, D]."""
    H, D = 4, 32
    batch = make_batch(mixed_reqs(block_size), H, H, D, block_size, seed=block_size)
    out = run_backend("sdpa", batch)
    meta, plan, scale = batch.meta, batch.meta.plan, batch.scale
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_reference(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping)
    q, expected = batch.q, torch.empty_like(batch.q)
    for run in plan.decode_runs:  # the MHA code these calls had before GQA
        rows, L = run.b - run.a, run.real.shape[-1]
        k = k_cache.index_select(0, run.blocks).view(rows, L, H, D).transpose(1, 2)  # [rows, H, L, D]
        v = v_cache.index_select(0, run.blocks).view(rows, L, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q[run.a : run.b, :, None], k, v, attn_mask=run.real, scale=scale)
        expected[run.a : run.b] = y[:, :, 0]
    for c in plan.chunks:
        q_c = q[c.s : c.e].transpose(0, 1)  # [H, T, D]
        if c.blocks is None:
            k_c, v_c = batch.key[c.s : c.e].transpose(0, 1), batch.value[c.s : c.e].transpose(0, 1)
        else:
            k_c = k_cache.index_select(0, c.blocks).flatten(0, 1)[: c.seq_len].transpose(0, 1)  # [H, L, D]
            v_c = v_cache.index_select(0, c.blocks).flatten(0, 1)[: c.seq_len].transpose(0, 1)
        y = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=c.causal, is_causal=c.causal is None, scale=scale)
        expected[c.s : c.e] = y.transpose(0, 1)
    assert torch.equal(out, expected)
    assert_close(out, dense_attention(batch), torch.float32)


def test_a_head_count_that_does_not_divide_is_a_clear_error():
    batch = make_batch(mixed_reqs(4), 4, 4, 32, 4)
    k_cache = batch.k_cache[:, :, :3].contiguous()  # 3 K/V heads for 4 query heads
    meta = batch.meta
    with pytest.raises(ValueError, match="H % Hkv must be 0"):
        attention_reference(batch.q, k_cache, k_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 1.0)
    meta.plan = plan_sdpa(meta, 4)
    with pytest.raises(ValueError, match="H % Hkv must be 0"):
        get_backend("sdpa", "cpu").forward(batch.q, batch.key, batch.value, k_cache, k_cache, meta, 1.0)


# ---------------------------------------------------------------------------------------------------------
# The C++ decode kernel: each K/V row read once for the G query heads of its group
# ---------------------------------------------------------------------------------------------------------

KERNEL_SHAPES = [(32, 1, torch.int64), (64, 16, torch.int32), (80, 8, torch.int32), (128, 16, torch.int64)]


@pytest.mark.skipif("not _cpu_kernel_builds()")
@pytest.mark.parametrize(("D", "block_size", "index_dtype"), KERNEL_SHAPES)
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_decode_kernel_equals_dense_attention(dtype, H, Hkv, D, block_size, index_dtype):
    from roseinfer.attention.cpu_paged import paged_decode_cpu

    reqs = [(n, 1) for n in (1, block_size, 3 * block_size + 2, 4 * block_size, 7)]
    batch = make_batch(reqs, H, Hkv, D, block_size, dtype, seed=H + 3 * Hkv + D)
    write_kv_reference(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    tables, lens = batch.meta.block_tables.to(index_dtype), batch.meta.seq_lens.to(index_dtype)
    out = paged_decode_cpu(batch.q, batch.k_cache, batch.v_cache, tables, lens, batch.scale)
    assert_close(out, dense_attention(batch).to(dtype), dtype)


@pytest.mark.skipif("not _cpu_kernel_builds()")
def test_the_cpu_decode_kernel_rejects_heads_that_do_not_divide():
    from roseinfer.attention.cpu_paged import paged_decode_cpu

    q, cache = torch.zeros(2, 4, 32), torch.zeros(4, 8, 3, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="H % Hkv"):
        paged_decode_cpu(q, cache, cache, tables, lens, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Triton (in its CPU interpreter here): write_kv, decode (v1 and split-K), prefill, the whole backend
# ---------------------------------------------------------------------------------------------------------

triton_only = pytest.mark.skipif(not HAS_TRITON or not INTERPRET, reason="needs triton, run in its CPU interpreter")


@triton_only
@pytest.mark.parametrize("Hkv", [1, 2, 3])
def test_triton_write_kv_with_fewer_kv_heads(Hkv):
    from roseinfer.attention.triton_kernels import write_kv_triton

    H, N, D, bs = 6, 7, 16, 4
    qkv = torch.randn(N, H + 2 * Hkv, D)  # one fused projection: q, k, v are views with token stride (H + 2Hkv) D
    key, value = qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
    slots = torch.tensor([9, -1, 0, 31, 17, -1, 12])  # -1 = padding, skipped
    k_ref, v_ref = torch.randn(8, bs, Hkv, D), torch.randn(8, bs, Hkv, D)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)


@triton_only
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
def test_triton_decode_kernels_with_gqa(H, Hkv, block_size):
    from roseinfer.attention.triton_kernels import paged_attention_triton, paged_attention_triton_split

    reqs = [(n, 1) for n in (1, block_size, 2 * block_size + 3, 3 * block_size)]
    batch = make_batch(reqs, H, Hkv, 16, block_size, seed=H + Hkv + block_size)
    k_cache, v_cache, meta = batch.k_cache, batch.v_cache, batch.meta
    write_kv_reference(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping)
    expected = dense_attention(batch)
    out = paged_attention_triton(batch.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, batch.scale)
    assert_close(out, expected, torch.float32)
    out = paged_attention_triton_split(batch.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, batch.scale, 3)
    assert_close(out, expected, torch.float32)


@triton_only
@pytest.mark.parametrize(("D", "block_size"), [(16, 4), (32, 16)])
@pytest.mark.parametrize(("H", "Hkv"), HEADS)
def test_the_triton_backend_with_gqa_on_a_mixed_batch(H, Hkv, D, block_size):
    """write_kv_triton, then decodes -> the decode kernel and chunks -> the prefill kernel, in one forward."""
    reqs = [(1, 1), (2 * block_size + 3, 1), (2 * block_size + 5, 7), (block_size + 2, block_size + 2)]
    batch = make_batch(reqs, H, Hkv, D, block_size, seed=H * Hkv + D)
    assert_close(run_backend("triton", batch), dense_attention(batch), torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_gqa_triton_kernels_compile_for_sm80_and_sm90(tmp_path):
    """tools/triton_aot.py --gqa-only: every kernel at the GQA shapes (G = 3 and 7) compiles to a cubin for
    sm_80 and sm_90, in a process without TRITON_INTERPRET, with no register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "gqa.json"
    proc = subprocess.run([sys.executable, "tools/triton_aot.py", "--gqa-only", "--json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    # then stage 20's fused ops and stage 22's W8A8 kernels, compiled at the GQA shapes too
    kernels = {"_write_kv_kernel", "_paged_attention_kernel", "_paged_attention_split_kernel",
               "_reduce_splits_kernel", "_prefill_attention_kernel", "_copy_blocks_kernel",
               "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
               "_int8_quant_kernel", "_scaled_mm_kernel"}  # fmt: skip
    compiled = {(r["kernel"], r["shape"], r["target"]) for r in report["gqa_results"]}
    assert compiled == {(k, s, t) for k in kernels for s in report["gqa_shapes"] for t in ("sm_80", "sm_90")}
    for r in report["gqa_results"]:
        assert r["cubin_bytes"] > 0 and 0 < r["registers"] <= 255 and r["local_bytes"] == 0, r
