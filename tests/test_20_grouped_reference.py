"""Stage 20: the grouped decode reference (the C++ kernel's loop, in PyTorch) against the gather reference and
against the kernel."""

from __future__ import annotations

import pytest
import torch

from roseinfer import custom_ops
from roseinfer.attention.reference import grouped_decode_reference, paged_attention_reference


def make_batch(H, Hkv, D, lens, block_size=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g)  # each sequence's blocks scattered over the pool
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = ids[at : at + n]
        at += n
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("chunk", [5, 16, 256])
def test_the_grouped_tile_equals_the_gather_reference(H, Hkv, chunk):
    q, k_cache, v_cache, tables, lens = make_batch(H, Hkv, 32, [1, 17, 40, 300])
    want = paged_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
    got = grouped_decode_reference(q, k_cache, v_cache, tables, lens, 0.125, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not custom_ops.available(), reason="the C++ extension cannot be built here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_cpu_kernel_runs_the_grouped_tile(dtype, tol):
    q, k_cache, v_cache, tables, lens = make_batch(9, 3, 64, [3, 129, 512, 700], dtype=dtype)
    want = grouped_decode_reference(q, k_cache, v_cache, tables, lens, 0.125)
    got = torch.ops.roseinfer.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
