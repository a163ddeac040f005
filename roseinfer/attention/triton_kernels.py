"""Paged attention in Triton: the KV write kernel and the decode attention kernels.

How to read a Triton kernel
---------------------------
A `@triton.jit` function is a *program*. Launching it with `kernel[grid](...)` runs one copy of the
program for every point of the grid, in parallel; on a GPU each copy is one thread block.
`tl.program_id(axis)` tells a program which point of the grid it is, and so which piece of work is
its own. Inside a program we do not write per-thread code: we work on small tensors ("tiles") whose
shapes are compile-time constants (`tl.constexpr`), and Triton spreads each tile over the threads.

Memory is reached through pointers: `ptr + offsets` with a tensor of offsets is a tensor of pointers,
`tl.load` reads them all into a tile, `tl.store` writes a tile back. A `mask` switches lanes off, so a
tile can hang over the end of ragged data: masked lanes read `other` and write nothing.

Layout (one layer): `k_cache`, `v_cache`: [num_blocks, block_size, Hkv, D]. Slot `s` is block
`s // block_size`, offset `s % block_size`. Logical block `i` of sequence `b` is physical block
`block_tables[b, i]`.

Grouped-query attention: the pools hold Hkv <= H heads, and query head h reads K/V head h // G, with
G = H // Hkv (`num_queries_per_kv`, vLLM's name; 1 for MHA). The attention kernels keep one program per
(sequence, query head) and compute that index: the G programs of a group read the same K/V rows, the
first from memory, the others mostly from the GPU's L2 cache, where they run at the same time. A launch
with G = 1 compiles to today's MHA kernel: Triton specializes an int argument equal to 1 into a constant,
so `head // 1` folds away.

fp8 pools (float8_e4m3fn): every load converts `.to(tl.float32)`; the write saturates at ±448 (triton_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roseinfer.attention.triton_fp8 import _to_cache

# --------------------------------------------------------------------------------------------------
# 1. Writing new K/V into the pool (vLLM's reshape_and_cache)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [N, Hkv, D] K of the new tokens (last dim contiguous)
    value_ptr,  # [N, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] float, or float8_e4m3fn (kv_cache_dtype="fp8")
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], same strides and dtype as k_cache
    slot_mapping_ptr,  # [N] int32/int64
    stride_kn,  # elements between two tokens of `key` (not Hkv * D when key is a slice of a fused QKV)
    stride_kh,  # elements between two heads of `key`
    stride_vn,
    stride_vh,
    stride_cache_block,  # elements between two blocks of the pool
    stride_cache_slot,  # elements between two tokens of a block
    stride_cache_head,  # elements between two heads of a token
    num_heads,  # Hkv, the pool's heads, a runtime value: it need not be a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,  # D, a power of two
    HEADS_POW2: tl.constexpr,  # Hkv rounded up to a power of two: tile shapes must be powers of two
):
    # The grid is (N,): one program copies all heads of one token.
    token = tl.program_id(0).to(tl.int64)  # int64 so `token * stride` cannot overflow on long prompts
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # a scalar load: the token's physical slot
    if slot < 0:  # padding token (e.g. a CUDA-graph batch filled up with dummies): nothing to write
        return
    block = slot // BLOCK_SIZE  # physical block ...
    offset = slot % BLOCK_SIZE  # ... and position inside it

    heads = tl.arange(0, HEADS_POW2)  # [HEADS_POW2] 0, 1, 2, ...: the head index of each tile row
    dims = tl.arange(0, HEAD_DIM)  # [D] the element index of each tile column
    mask = (heads < num_heads)[:, None]  # [HEADS_POW2, 1] rows past Hkv are switched off (broadcasts over D)

    # [HEADS_POW2, 1] + [1, D] broadcasts to a [HEADS_POW2, D] tile of offsets: one per element to move.
    src_k = key_ptr + token * stride_kn + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vn + heads[:, None] * stride_vh + dims[None, :]
    dst = block * stride_cache_block + offset * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]

    k = tl.load(src_k, mask=mask)  # [HEADS_POW2, D] one token's K, all heads
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr), mask=mask)  # cast to the cache dtype (fp8: saturated)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [N] int32/int64, < 0 = skip
) -> None:
    """Scatter each new token's K/V into slot `slot_mapping[i]` of the pool; negative slots are skipped."""
    N, Hkv, D = key.shape
    _check_cache(k_cache, v_cache, Hkv, D)
    assert value.shape == key.shape and slot_mapping.shape == (N,), "key/value [N, Hkv, D], slot_mapping [N]"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "the head dim of key/value must be contiguous"
    if N == 0:
        return
    _write_kv_kernel[(N,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        Hkv, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=D, HEADS_POW2=triton.next_power_of_2(Hkv),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# 2. Paged decode attention: one program per (sequence, head), online softmax over the blocks
# --------------------------------------------------------------------------------------------------


@triton.jit
def _attend_blocks(
    q,  # [D] fp32 tile: this head's query, already multiplied by the scale
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,  # pointer to this sequence's row of block_tables
    kv_head,  # which head of the pool to read (the query head's K/V head)
    context_len,  # tokens of this sequence; positions >= context_len are masked
    first_block,  # logical blocks [first_block, end_block) are visited
    end_block,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Attend `q` to a run of blocks with the online softmax; return (m, l, acc) for that run.

    Softmax needs the max score before any exp (for stability) and the sum of all exps, but the
    scores arrive one block at a time. So keep running values and fix them up as we go:
      m   = max score seen so far
      l   = sum of exp(score - m) so far
      acc = sum of exp(score - m) * v so far                                  [D]
    When a new block raises the max from m to m_new, every old term shrinks by alpha = exp(m - m_new):
    multiply l and acc by alpha, then add the new block's terms. At the end out = acc / l, exactly the
    softmax-weighted sum of V, computed in one pass without ever holding all scores.
    """
    tokens = tl.arange(0, BLOCK_SIZE)  # [BS] offsets of the tokens inside one block
    dims = tl.arange(0, HEAD_DIM)  # [D]
    m_i = float("-inf")  # running max (a fp32 scalar once the loop has run)
    l_i = 0.0  # running sum of exps
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)  # [D] running weighted sum of V rows

    for logical_block in range(first_block, end_block):  # a real loop on the GPU; its bounds are runtime values
        physical_block = tl.load(table_ptr + logical_block).to(tl.int64)  # the only indirection of paging
        positions = logical_block * BLOCK_SIZE + tokens  # [BS] positions of these tokens in the sequence
        in_context = positions < context_len  # [BS] False past the end (the last block is usually partial)

        # [BS, 1] + [1, D] -> [BS, D] offsets of the K tile. In this layout one row (one token's head) is
        # D contiguous elements, and consecutive tokens are Hkv * D elements apart.
        kv = physical_block * stride_cache_block + tokens[:, None] * stride_cache_slot
        kv = kv + kv_head * stride_cache_head + dims[None, :]
        k = tl.load(k_cache_ptr + kv, mask=in_context[:, None], other=0.0).to(tl.float32)  # [BS, D]

        scores = tl.sum(k * q[None, :], axis=1)  # [BS] q . k for each token: multiply, then sum over D
        scores = tl.where(in_context, scores, float("-inf"))  # masked tokens get exp(-inf) = 0 weight

        m_new = tl.maximum(m_i, tl.max(scores, axis=0))  # new running max (finite: every block has a real token)
        alpha = tl.exp(m_i - m_new)  # how much the old terms shrink (exp(-inf) = 0 on the first block)
        p = tl.exp(scores - m_new)  # [BS] unnormalised probabilities of this block

        v = tl.load(v_cache_ptr + kv, mask=in_context[:, None], other=0.0).to(tl.float32)  # [BS, D]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [D] = old terms rescaled + p-weighted V rows
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [B, H, D]
    q_ptr,  # [B, H, D]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    scale,
    num_queries_per_kv,  # G = H // Hkv: query head h reads K/V head h // G (1 for MHA)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_table,  # elements between two rows of block_tables
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # The grid is (B, H): one program computes the output of one (query) head of one sequence.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // num_queries_per_kv  # the pool's head this query head reads (GQA)
    context_len = tl.load(context_lens_ptr + seq)  # read on the GPU: the host never needs the lengths
    dims = tl.arange(0, HEAD_DIM)  # [D]

    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)  # [D], math in fp32
    q = q * scale  # scaling q once is cheaper than scaling every score
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)  # blocks this sequence uses; the rest of its row is never read
    m_i, l_i, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_table, kv_head, context_len, 0, num_blocks,
        stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE, HEAD_DIM,
    )  # fmt: skip
    out = acc / l_i  # [D] normalise once at the end
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], H % Hkv == 0
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D], written in place if given
) -> torch.Tensor:
    """Decode attention over the paged KV cache: grid (B, H), each program walks its sequence's blocks."""
    B, H, D = q.shape
    G = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1, "out must be [B, H, D] with a contiguous last dim"
    _paged_attention_kernel[(B, H)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale, G,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=D,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# 3. Split-K ("flash-decoding", vLLM's v2): more programs for few, long sequences
# --------------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_split_kernel(
    m_ptr,  # [B, H, S] fp32 scratch: running max of each split
    l_ptr,  # [B, H, S] fp32 scratch: sum of exps of each split
    acc_ptr,  # [B, H, S, D] fp32 scratch: unnormalised output of each split
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    num_queries_per_kv,  # G: query head h reads K/V head h // G
    stride_qb,
    stride_qh,
    stride_table,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # The grid is (B, H, S): the blocks of one (sequence, head) are shared out among S programs.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // num_queries_per_kv
    num_heads = tl.num_programs(1)  # the grid's size along an axis
    num_splits = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)
    dims = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32) * scale  # [D]
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, num_splits)  # each sequence is cut into S equal runs of blocks
    first = split * blocks_per_split
    end = tl.minimum(first + blocks_per_split, num_blocks)  # a short sequence leaves some splits empty
    m_i, l_i, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_table, kv_head, context_len, first, end,
        stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE, HEAD_DIM,
    )  # fmt: skip
    # An empty split stores m = -inf, l = 0, acc = 0: the reduce gives it weight exp(-inf) = 0.
    row = (seq * num_heads + head) * num_splits + split  # index into the contiguous [B, H, S] scratch
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row * HEAD_DIM + dims, acc)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [B, H, D]
    m_ptr,  # [B, H, S]
    l_ptr,  # [B, H, S]
    acc_ptr,  # [B, H, S, D]
    stride_ob,
    stride_oh,
    num_splits,  # S
    SPLITS_POW2: tl.constexpr,  # S rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    # The grid is (B, H): merge the S partial softmaxes of one (sequence, head), as the online softmax
    # merges blocks: rescale every split to the global max, then add.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * num_splits  # first split of this (sequence, head)
    splits = tl.arange(0, SPLITS_POW2)  # [S_POW2]
    valid = splits < num_splits  # [S_POW2]
    dims = tl.arange(0, HEAD_DIM)  # [D]

    m_s = tl.load(m_ptr + row0 + splits, mask=valid, other=float("-inf"))  # [S_POW2]
    l_s = tl.load(l_ptr + row0 + splits, mask=valid, other=0.0)  # [S_POW2]
    acc_offs = (row0 + splits)[:, None] * HEAD_DIM + dims[None, :]  # [S_POW2, D]
    acc_s = tl.load(acc_ptr + acc_offs, mask=valid[:, None], other=0.0)  # [S_POW2, D]

    m_max = tl.max(m_s, axis=0)  # global max (finite: at least one split saw a real token)
    w = tl.exp(m_s - m_max)  # [S_POW2] rescale factor of each split; 0 for empty or padding splits
    l_total = tl.sum(w * l_s, axis=0)  # the softmax denominator over the whole sequence
    out = tl.sum(w[:, None] * acc_s, axis=0) / l_total  # [D]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton_split(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], H % Hkv == 0
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    num_splits: int = 4,
    out: torch.Tensor | None = None,  # [B, H, D]
) -> torch.Tensor:
    """Flash-decoding: grid (B, H, num_splits) partial softmaxes, then a (B, H) reduce kernel merges them.

    Worth it when B * H programs are too few to fill the GPU (a few long sequences); each split
    reads 1 / num_splits of the context, at the cost of a second launch and a small fp32 scratch.
    """
    B, H, D = q.shape
    G = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    assert num_splits >= 1, "num_splits must be >= 1"
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1, "out must be [B, H, D] with a contiguous last dim"
    m_buf = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)  # [B, H, S]
    l_buf = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)  # [B, H, S]
    acc_buf = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)  # [B, H, S, D]
    _paged_attention_split_kernel[(B, H, num_splits)](
        m_buf, l_buf, acc_buf, q, k_cache, v_cache, block_tables, context_lens, scale, G,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=D,
    )  # fmt: skip
    _reduce_splits_kernel[(B, H)](
        out, m_buf, l_buf, acc_buf, out.stride(0), out.stride(1), num_splits,
        SPLITS_POW2=triton.next_power_of_2(num_splits), HEAD_DIM=D,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Argument checks: a wrong stride or a non-power-of-two tile is a silent wrong answer, so fail loudly.
# --------------------------------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, Hkv: int, D: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, D), "k_cache must be [num_blocks, block_size, Hkv, D]"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "v_cache must match k_cache"
    assert k_cache.stride(-1) == 1, "the head dim of the cache must be contiguous"
    assert _is_pow2(k_cache.shape[1]), f"block_size must be a power of two, got {k_cache.shape[1]}"
    assert _is_pow2(D), f"head_dim must be a power of two, got {D}"


def _kv_groups(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """G = H // Hkv for q [.., H, D] and a pool [num_blocks, block_size, Hkv, D]; checks the pool's shape."""
    H, D = q.shape[-2:]
    assert k_cache.dim() == 4 and k_cache.shape[-1] == D, "k_cache must be [num_blocks, block_size, Hkv, D]"
    Hkv = k_cache.shape[2]
    assert Hkv >= 1 and H % Hkv == 0, f"{H} query heads cannot share {Hkv} K/V heads: H % Hkv must be 0"
    return H // Hkv


def _check_attention_args(q, k_cache, v_cache, block_tables, context_lens) -> int:
    """Checks the arguments of a decode launch; returns G, the query heads per K/V head."""
    B, H, D = q.shape
    G = _kv_groups(q, k_cache)
    _check_cache(k_cache, v_cache, H // G, D)
    assert q.stride(-1) == 1, "the head dim of q must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.stride(1) == 1
    assert context_lens.shape == (B,) and context_lens.stride(0) == 1, "context_lens must be a contiguous [B]"
    assert not block_tables.is_floating_point() and not context_lens.is_floating_point()
    return G


def paged_attention_auto(q, k_cache, v_cache, block_tables, context_lens, scale, out=None) -> torch.Tensor:
    """The engine's entry point: the one-program-per-(sequence, head) kernel, or split-K when there are
    too few (sequence, head) pairs to fill the GPU and the contexts are long (flash-decoding's case)."""
    B, H, _ = q.shape
    max_context = block_tables.shape[1] * k_cache.shape[1]  # an upper bound, known without a device sync
    if q.is_cuda and max_context >= 1024:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        if sms > B * H:  # too few (sequence, head) programs to fill the GPU
            splits = min(16, triton.cdiv(2 * sms, B * H), triton.cdiv(max_context, 512))
            return paged_attention_triton_split(q, k_cache, v_cache, block_tables, context_lens, scale, splits, out)
    return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, out)
