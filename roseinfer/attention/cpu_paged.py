"""Attention that reads the paged KV cache in place, on a CPU: the C++ kernels of `roseinfer/csrc/paged_attention.cpp`.

The sdpa backend (`sdpa.py`) copies every row's blocks into one contiguous buffer per layer (`index_select`) and
only then calls PyTorch's SDPA on it, so the K/V of every context are read, written and read again. These kernels
walk each sequence's block table instead: every K and V vector is read once, from where the pool holds it.

One loop serves decodes and prefill chunks. Its unit of work is one sequence and R query rows of it: a decode's H
query heads over all Hkv K/V heads at once when the batch has sequences enough for the threads, else the G = H / Hkv
heads of one K/V head j (a decode with few sequences; a prefill chunk, its tokens x G heads). Per K/V head j,
the rows that read it go through this:

    Q [R, D] (fp32, x scale)      K/V head j: token t's row at slot = table[t // bs] * bs + t % bs
         |                         k_cache[slot, j]  [D]   (bf16/fp16 converted to fp32 as loaded)
         v
    for each chunk of 256 tokens:
      S [R, 256] = Q . K^T        a tile of 16 tokens at a time: up to RB rows' q held in registers, each
                                  K row loaded ONCE per RB rows, RB rows of FMAs over D  ->  R x 16
                                  vectors of partial sums, finished 16 at a time: lane i of
                                  sum_lanes(v[0..15]) = sum of v[i]
      m' = max(m, rowmax S);  P = exp(S - m')          a vector of 16 tokens per exp (exp_u20)
      acc [R, D] = acc * exp(m - m') + P . V           RB rows' acc in registers while the V rows stream past
      l = l * exp(m - m') + rowsum P                   (online softmax, as flash attention)
    out = acc / l

Why it is faster than one (token, head) dot product at a time: decode attention does ~2 FLOPs per byte of K/V,
so its cost is the bytes it brings in and the instructions around each FLOP. Loading a K row once for G heads
cuts the loads G times (GQA's point: G times fewer bytes than MHA). A dot product over D=64 floats is 4 vector
FMAs but ends in a horizontal sum (about 8 shuffles and adds) to make one number; finishing 16 dot products
together with a transpose-and-add tree costs 45 instructions for all 16. The softmax's exp is a vector
polynomial over 16 scores instead of 16 calls to std::exp. The pool is [num_blocks, block_size, Hkv, D]: a
token's Hkv rows lie side by side, so a decode item that takes all heads reads a block's K (and V) as one
contiguous run of block_size x Hkv x D values instead of Hkv strided runs of D.

Work is split with at::parallel_for over those items: (sequence) when there are at least 2 x threads of them,
else (sequence, K/V head) pairs. When even the pairs are fewer than 2 x threads (one long sequence, a small batch),
each sequence is also cut into 256-token chunks, items of their own (flash-decoding); each chunk keeps its
unnormalised (acc, m, l) and a second pass merges them:

    M = max_c m_c      out = sum_c acc_c * exp(m_c - M) / sum_c l_c * exp(m_c - M)

    tokens  0 ......... 255 | 256 ........ 511 | 512 .... 700     one sequence, one K/V head
            (acc0, m0, l0)  | (acc1, m1, l1)   | (acc2, m2, l2)   three items, on any threads
                             +--------- log-sum-exp merge ---+   -> out [G, D]

A prefill chunk of T tokens after `ctx` cached ones uses the same loop with R = (a few tokens) x G rows: row
(i, g) sees tokens 0 .. ctx + i (causal, masked inside the last 256-token chunk it reaches), and its own K/V are
read from the pool, where the layer has just written them. No gather of the context, no K/V repeated G times.

The scratch (Q, acc, scores) is each thread's own buffer, grown once and reused by every call. The library is
built once with the machine's compiler the first time it is used (`roseinfer/custom_ops.py`, `-march=native`,
so at::vec uses AVX-512 where the CPU has it). The PyTorch reference (`reference.py`) stays the oracle.
"""

from __future__ import annotations

import torch

from roseinfer import custom_ops


def load_kernel() -> bool:
    """Whether the kernel is there: the project's C++ extension (`roseinfer/custom_ops.py`) built and loaded."""
    return custom_ops.available()


def paged_decode_cpu(
    q: torch.Tensor,  # [B, H, D] one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], H % Hkv == 0
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (or int64), row b = sequence b's blocks
    seq_lens: torch.Tensor,  # [B] the same dtype, tokens each sequence attends to (≥ 1)
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Decode attention for a batch, read through the block tables (the signature of the reference's)."""
    # (torch.profiler's tables name the op itself, roseinfer::paged_decode: a record_function wrapper here, as in
    # stage 17, cost ~6 µs a call, 30 times a step)
    return torch.ops.roseinfer.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_cpu(
    q: torch.Tensor,  # [T, H, D] one request's chunk: the last T of its seq_len tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the chunk's own K/V already written
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32 (or int64), the request's blocks
    seq_len: int,  # tokens in the context after this chunk (earlier + T)
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention for one prefill chunk through its block table: query i sees tokens 0 .. seq_len - T + i."""
    return torch.ops.roseinfer.paged_prefill(q.contiguous(), k_cache, v_cache, block_table, seq_len, scale)
