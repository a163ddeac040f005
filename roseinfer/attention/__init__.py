"""Attention over the paged KV cache.

Per forward pass the engine builds an `AttentionMetadata` (vLLM's names):

    slot_mapping  [N]              the physical slot each new token's K/V is written to:
                                   slot = block_id * block_size + offset
    block_tables  [B, max_blocks]  int32, row b = sequence b's physical blocks in logical order
    context_lens  [B]              int32, tokens each sequence attends to (the new one included)

`write_kv` scatters K/V into the pool; `paged_attention` is decode attention that reads
each sequence's keys and values through its block table. Both are the PyTorch reference
in `reference.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.attention.reference import paged_attention_reference as paged_attention
from roseinfer.attention.reference import write_kv_reference as write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]


@dataclass
class AttentionMetadata:
    is_prefill: bool  # prefill: one prompt, B = 1, T = its length; decode: B sequences, T = 1
    slot_mapping: torch.Tensor  # [B * T] int64
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (decode)
    context_lens: torch.Tensor | None = None  # [B] int32 (decode)
