"""Attention over the paged KV cache, for a step's whole flattened batch, with three backends.

Each step runs ONE forward over the new tokens of every scheduled request, flattened into N rows:
decodes first (one token each), then prefill chunks (several tokens each). The model runner builds an
`AttentionMetadata` for the step (vLLM's names):

    slot_mapping     [N]              the physical slot each new token's K/V go to:
                                      slot = block_id * block_size + offset
    query_start_loc  [B + 1] int32    request b's new tokens are rows query_start_loc[b] .. [b + 1] - 1
    seq_lens         [B] int32        tokens request b attends to after this step (earlier + new)
    block_tables     [B, max_blocks]  int32, row b = request b's physical blocks in logical order

The tensors of one layer (grouped-query attention: Hkv K/V heads, H % Hkv == 0, G = H // Hkv query heads
share one K/V head, query head h reads K/V head h // G; Hkv == H is MHA, Hkv == 1 MQA):

    q, out              [N, H, D]                          the new tokens' queries, the attention output
    key, value          [N, Hkv, D]                        the new tokens' K/V
    k_cache, v_cache    [num_blocks, block_size, Hkv, D]   the pools; each backend reads Hkv from them

A backend provides three operations, and may prepare per-step work that every layer reuses:
    write_kv(key, value, k_cache, v_cache, slot_mapping)           scatter new K/V into the pool
    forward(q, key, value, k_cache, v_cache, meta, scale) -> out   attention for the whole batch
    copy_blocks(kv_caches, block_mapping)                          copy-on-write, once per step before the
                                                                   forward: block src -> dst, every layer's K and V
    prepare(meta, block_size) -> plan                              once per step, before the forward

    torch   `reference.py`: one request at a time, gather + masked softmax in fp32. The oracle.
    sdpa    `sdpa.py`: a flat KV write, block gathers + PyTorch's fused SDPA.
    cpu     `cpu_paged.py`'s C++ kernels for decode rows and prefill chunks, which read the blocks in place (no
            gathers); sdpa's cascade attention for decodes behind a shared prefix. The fast path on a CPU; it is
            compiled the first time it is used.
    triton  `triton_kernels.py` (decode) + `triton_prefill.py` (prefill chunks) + `triton_copy.py`
            (copy_blocks). CUDA, or CPU under TRITON_INTERPRET=1. torch and sdpa copy blocks with the reference.
    auto    triton on CUDA; on a CPU, cpu where its kernel builds, else sdpa.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from roseinfer.attention.reference import (
    attention_reference,
    copy_blocks_reference,
    paged_attention_reference,
    write_kv_reference,
)
from roseinfer.attention.sdpa import GatherBuffer, attention_sdpa, plan_sdpa, write_kv_flat

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "GatherBuffer",
    "TORCH_BACKEND",
    "get_backend",
    "resolve_backend_name",
    "paged_attention",
    "write_kv",
]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    forward: Callable[..., torch.Tensor]
    prepare: Callable[[AttentionMetadata, int], Any] | None = None  # once per step: (meta, block_size) -> plan
    copy_blocks: Callable[[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor], None] = copy_blocks_reference


def _reference_forward(q, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return attention_reference(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)


TORCH_BACKEND = AttentionBackend("torch", write_kv_reference, _reference_forward)
SDPA_BACKEND = AttentionBackend("sdpa", write_kv_flat, attention_sdpa, plan_sdpa)
write_kv, paged_attention = write_kv_reference, paged_attention_reference  # the reference, by name


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' | 'torch' | 'sdpa' | 'cpu' | 'triton' for a device: 'auto' is triton on CUDA (when triton imports),
    cpu on a CPU (when its kernel builds, else sdpa); a backend that cannot run there is a clear error."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "sdpa"
        return "cpu" if _cpu_kernel() else "sdpa"
    if name in ("torch", "sdpa"):
        return name
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU, not on {device}; use 'auto'")
        if not _cpu_kernel():
            raise ValueError("attention_backend='cpu' needs its C++ kernel, which could not be built here (a C++ "
                             "compiler and ninja are needed); use 'sdpa'")  # fmt: skip
        return name
    if name != "triton":
        raise ValueError(f"unknown attention_backend {name!r}; use 'auto', 'torch', 'sdpa', 'cpu' or 'triton'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA GPU; on CPU, Triton kernels only run in its "
            "interpreter (set TRITON_INTERPRET=1 before starting Python, slow, for tests)"
        )
    if not _triton_importable():
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton==3.7.1)")
    return name


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` (resolved for `device` as above)."""
    name = resolve_backend_name(name, device)
    if name in ("torch", "sdpa"):
        return TORCH_BACKEND if name == "torch" else SDPA_BACKEND
    if name == "cpu":
        from roseinfer.attention.cpu_paged import paged_decode_cpu, paged_prefill_cpu

        forward_cpu = functools.partial(attention_sdpa, decode_kernel=paged_decode_cpu, chunk_kernel=paged_prefill_cpu)
        plan_cpu = functools.partial(plan_sdpa, gather_decodes=False, gather_chunks=False)
        return AttentionBackend("cpu", write_kv_flat, forward_cpu, plan_cpu)
    from roseinfer.attention import triton_copy as tc
    from roseinfer.attention import triton_kernels as tk
    from roseinfer.attention import triton_prefill as tp

    def forward(q, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return tp.attention_triton(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                   meta.num_decodes, meta.max_query_len, scale)  # fmt: skip

    return AttentionBackend("triton", tk.write_kv_triton, forward, copy_blocks=tc.copy_blocks_triton)


def _cpu_kernel():
    from roseinfer.attention.cpu_paged import load_kernel

    return load_kernel()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class AttentionMetadata:
    """One step's batch, as attention sees it (see the module docstring for the tensors)."""

    slot_mapping: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    num_decodes: int  # requests 0 .. num_decodes-1 have exactly one new token (rows 0 .. num_decodes-1)
    max_query_len: int  # host ints, known without a device sync: grid sizes, loops on the CPU
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    backend: AttentionBackend = TORCH_BACKEND
    gather_buffer: GatherBuffer | None = None  # the model runner's scratch for the sdpa backend's gathers
    plan: Any = None  # what `backend.prepare` worked out for this step, reused by every layer
