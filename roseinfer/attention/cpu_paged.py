"""Decode attention that reads the paged KV cache in place, on a CPU: a small C++ kernel.

The sdpa backend (`sdpa.py`) copies every decode row's blocks into one contiguous buffer per layer
(`index_select`) and only then calls PyTorch's SDPA on it, so the K/V of every context are read, written and
read again. Decode attention does almost no arithmetic (one query row per sequence): its cost is the bytes
it moves, and the copy doubles them. This kernel walks each row's block table instead:

    for each sequence b, in parallel over torch's threads:
        for t in 0 .. seq_len[b] - 1:     slot = block_tables[b, t // block_size] * block_size + t % block_size
            for every K/V head j:                                                K row [Hkv, D]: one read
                s[h, t] = (q[b, h] · k_cache[slot, j]) · scale   for the G heads h = j * G .. j * G + G - 1
        p[h] = softmax(s[h])                                                     (max subtracted first)
        out[b, h] = Σ_t p[h, t] · v_cache[slot, h // G]                          V row [Hkv, D]: one read

Every K and V vector is read once, from where the pool holds it; nothing is copied or padded. The C++ is
`roseinfer/csrc/paged_attention.cpp`, one op of the project's extension (`roseinfer/custom_ops.py`), built once
with the machine's compiler the first time it is used, `-march=native` so the loops over the head dimension
use the CPU's vector units.
Prefill chunks still go through SDPA (`sdpa.py`): many queries per request make them GEMM-shaped, which its
flash kernel does well.

Grouped-query attention (Hkv = H / G K/V heads, query head h reads K/V head h // G): the G query heads of
a group come one after the other, the first reads the K/V vector from memory, the others from the core's
L1 cache. So a GQA model's decode attention moves G times fewer bytes than MHA with as many query heads.
G = 1 is MHA: the same loops, the same results to the bit.
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
    with torch.profiler.record_function("roseinfer::paged_decode_cpu"):  # named in torch.profiler's tables
        return torch.ops.roseinfer.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)
