"""Stage 20's CPU attention kernels (roseinfer/csrc/paged_attention.cpp) against the PyTorch reference.

paged_decode: all K/V heads of a sequence at a time when sequences are at least 2 x threads, else a K/V group at
a time, with the context split into 256-token chunks merged by log-sum-exp when (sequence, K/V head) pairs are
fewer than 2 x threads. paged_prefill: one chunk, causal after its context.
"""

from __future__ import annotations

import pytest
import torch

from roseinfer.attention.reference import attention_reference, paged_attention_reference

pytestmark = pytest.mark.skipif("not __import__('roseinfer.custom_ops').custom_ops.available()")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
SPLIT = 256  # kSplit in the kernel


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def pools(num_blocks, bs, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_blocks, bs, Hkv, D, generator=g)).to(dtype)
    v = (torch.randn(num_blocks, bs, Hkv, D, generator=g)).to(dtype)
    return k, v, g


def check_decode(B_lens, H, Hkv, D, bs, dtype, seed=0):
    width = max(-(-n // bs) for n in B_lens) + 1
    k, v, g = pools(len(B_lens) * width, bs, Hkv, D, dtype, seed)
    tables = torch.randperm(len(B_lens) * width, generator=g).view(len(B_lens), width).int()  # scrambled
    lens = torch.tensor(B_lens, dtype=torch.int32)
    q = torch.randn(len(B_lens), H, D, generator=g).to(dtype)
    out = torch.ops.roseinfer.paged_decode(q, k, v, tables, lens, D**-0.5)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), tables, lens, D**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_groups_and_head_sizes(G, D, dtype, threads):
    """Lengths crossing block boundaries (15, 16, 17, 33), one token, and one past a 256-token chunk."""
    threads(2)
    check_decode([1, 15, 16, 17, 33, 300, 7, 64], 2 * G, 2, D, 16, dtype, seed=G + D)


@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (8, 2, 128), (12, 4, 80), (4, 4, 32)])
def test_a_sequence_or_a_head_per_item(H, Hkv, D, threads):
    """4 sequences on 2 threads: an item is a sequence, all its heads; 3: an item is one K/V head of one."""
    threads(2)
    check_decode([33, 16, 200, 1], H, Hkv, D, 16, torch.float32, seed=H)
    check_decode([33, 16, 200], H, Hkv, D, 16, torch.float32, seed=H)
    check_decode([5, 9, 300, 31, 70, 64, 17, 2], H, Hkv, D, 8, torch.bfloat16, seed=D)


@pytest.mark.parametrize("n", [257, 700, 2048, 2049])
@pytest.mark.parametrize(("H", "Hkv"), [(9, 3), (8, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_long_single_sequence_is_split_and_merged(n, H, Hkv, dtype, threads):
    """One sequence, Hkv pairs < 2 x threads: its context goes in 256-token chunks, merged by log-sum-exp."""
    threads(2)
    assert Hkv < 2 * 2 and n > SPLIT  # the split path
    check_decode([n], H, Hkv, 64, 16, dtype, seed=n)


@pytest.mark.parametrize("D", [64, 40, 72])  # whole vectors of 16, and rows whose last vector is partial
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B_lens", [[33, 16, 200, 1], [700]])  # all heads of a sequence per item; split and merged
def test_a_half_precision_pool_reads_exactly_the_floats_it_holds(D, dtype, B_lens, threads):
    """The bf16/fp16 loads widen each element to fp32 exactly, so the kernel on such pools gives what the same
    kernel gives on the same values held in fp32, rounded to the dtype once at the end: equal, not close."""
    threads(2)
    k, v, g = pools(len(B_lens) * 48, 16, 3, D, dtype, seed=D)
    tables = torch.randperm(len(B_lens) * 48, generator=g).view(len(B_lens), 48).int()
    lens, q = torch.tensor(B_lens, dtype=torch.int32), torch.randn(len(B_lens), 9, D, generator=g).to(dtype)
    out = torch.ops.roseinfer.paged_decode(q, k, v, tables, lens, D**-0.5)
    wide = torch.ops.roseinfer.paged_decode(q.float(), k.float(), v.float(), tables, lens, D**-0.5)
    assert torch.equal(out, wide.to(dtype))
    chunk = torch.ops.roseinfer.paged_prefill(q[0, None].repeat(5, 1, 1), k, v, tables[0], B_lens[0] + 4, D**-0.5)
    wide = torch.ops.roseinfer.paged_prefill(q[0, None].repeat(5, 1, 1).float(), k.float(), v.float(), tables[0],
                                             B_lens[0] + 4, D**-0.5)  # fmt: skip
    assert torch.equal(chunk, wide.to(dtype))


def test_split_with_sequences_of_different_lengths(threads):
    """Chunks past a short sequence's end hold nothing and must not count in the merge."""
    threads(8)  # 2 sequences x 1 K/V head < 16: split, into ceil(1000 / 256) = 4 chunks each
    check_decode([1000, 5], 4, 1, 64, 16, torch.float32)
    check_decode([513, 256], 6, 2, 80, 8, torch.float32)


@pytest.mark.parametrize("threads_n", [1, 2])
def test_split_and_unsplit_agree(threads_n, threads):
    threads(threads_n)
    check_decode([600, 600], 9, 3, 64, 16, torch.float32)  # 6 pairs: unsplit at 1 and 2 threads
    check_decode([600], 9, 3, 64, 16, torch.float32)  # 3 pairs: split at 2 threads


@pytest.mark.parametrize(("T", "ctx"), [(1, 0), (16, 0), (17, 15), (64, 300), (300, 40), (5, 2048)])
@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 1, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_chunk_equals_the_reference(T, ctx, H, Hkv, D, dtype, threads):
    """T new tokens after ctx cached ones, every K/V in the pool: query i sees tokens 0 .. ctx + i."""
    threads(2)
    bs, n = 16, T + ctx
    width = -(-n // bs) + 1
    k, v, g = pools(width + 3, bs, Hkv, D, dtype, seed=T + ctx + D)
    table = torch.randperm(width + 3, generator=g)[:width].int()
    q = torch.randn(T, H, D, generator=g).to(dtype)
    out = torch.ops.roseinfer.paged_prefill(q, k, v, table, n, D**-0.5)
    ref = attention_reference(q.float(), k.float(), v.float(), table[None], torch.tensor([0, T]), torch.tensor([n]),
                              D**-0.5)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)


def test_prefill_rejects_a_table_too_short():
    k = torch.zeros(4, 16, 1, 32)
    with pytest.raises(RuntimeError, match="block table"):
        torch.ops.roseinfer.paged_prefill(torch.zeros(4, 2, 32), k, k, torch.zeros(1, dtype=torch.int32), 20, 1.0)
