"""Attention over the paged KV cache, with two backends.

Per forward pass the engine builds an `AttentionMetadata` (vLLM's names):

    slot_mapping  [N]              the physical slot each new token's K/V is written to:
                                   slot = block_id * block_size + offset
    block_tables  [B, max_blocks]  int32, row b = sequence b's physical blocks in logical order
    context_lens  [B]              int32, tokens each sequence attends to (the new one included)

A backend provides two operations:
    write_kv(key, value, k_cache, v_cache, slot_mapping)            scatter new K/V into the pool
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out   decode attention

    torch   `reference.py`: gather by block table + masked softmax. CPU and CUDA; the oracle.
    triton  `triton_kernels.py`: our kernels (stage 08). CUDA, or CPU under TRITON_INTERPRET=1.
    auto    triton on CUDA, torch on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roseinfer.attention.reference import paged_attention_reference, write_kv_reference

__all__ = ["AttentionBackend", "AttentionMetadata", "TORCH_BACKEND", "get_backend", "paged_attention", "write_kv"]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend("torch", write_kv_reference, paged_attention_reference)
write_kv, paged_attention = write_kv_reference, paged_attention_reference  # the reference, by name


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolve 'auto' | 'torch' | 'triton' for a device; a backend that cannot run there is a clear error."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "torch":
        return TORCH_BACKEND
    if name != "triton":
        raise ValueError(f"unknown attention_backend {name!r}; use 'auto', 'torch' or 'triton'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA GPU; on CPU, Triton kernels only run in its "
            "interpreter (set TRITON_INTERPRET=1 before starting Python, slow, for tests)"
        )
    if not _triton_importable():
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton==3.7.1)")
    from roseinfer.attention import triton_kernels as tk

    return AttentionBackend("triton", tk.write_kv_triton, tk.paged_attention_auto)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class AttentionMetadata:
    is_prefill: bool  # prefill: one prompt, B = 1, T = its length; decode: B sequences, T = 1
    slot_mapping: torch.Tensor  # [B * T] int64
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (decode)
    context_lens: torch.Tensor | None = None  # [B] int32 (decode)
    backend: AttentionBackend = TORCH_BACKEND
