"""Rotary position embeddings (RoPE): positions as rotations of q and k, applied before K is cached.

GPT-2 adds a learned position vector to the token embedding once, at the bottom. Llama-family
models instead rotate every query and key, in every layer, by an angle that grows with the
token's position. Split a head's D features into D/2 pairs (feature i and i + D/2, the
"rotate-half" layout Hugging Face uses); pair i turns by the angle pos · θ_i, where

    θ_i = rope_theta ^ (-2i / D)        i = 0 .. D/2 - 1   (fast-turning pairs first, slow ones last)

    [x_i      ]      [cos  -sin] [x_i      ]
    [x_{i+D/2}]  ->  [sin   cos] [x_{i+D/2}]      angle = pos · θ_i

A rotation by a and one by b leave q·k depending only on a - b, so attention sees *relative*
positions. For the engine this means: K is rotated with its own position before it is written
to the paged cache, and never touched again. Every later query is rotated with its position and
reads the cached keys as they are.

The cos/sin of a step's tokens are computed once per step, from their positions, and every layer
uses them for its q and k.

`rope_scaling` / `rope_parameters` of type "llama3" (Llama 3.1+) stretch the slow pairs for long
contexts: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided
by `factor`, those shorter than .../ high_freq_factor are kept, and the band between is blended.
"linear" divides every θ_i by `factor`. Other types are refused by name (llama_config.py).
"""

from __future__ import annotations

import math

import torch

from roseinfer.attention.sdpa import write_kv_flat
from roseinfer.model_executor.custom_op import CPU_KERNEL_DTYPES, CustomOp, triton_importable


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """θ_i for i = 0 .. D/2 - 1, in fp32 (as transformers computes them), scaled as `scaling` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long waves: stretched
    smooth = (old_len / wavelen - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """`forward(positions)` -> the (cos, sin) of a step's tokens, computed once per step and shared by every
    layer; `apply_rotary(x, cos, sin)` rotates q or k with them. No table of the whole context is kept: a
    step's N tokens cost N · D/2 products, the same fp32 products transformers computes."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (or [B, T]) -> cos, sin [N, 1, D] (or [B, T, 1, D]) in `dtype`, broadcast over heads."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [N, D/2]: pos · θ_i
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # [N, 1, D]: pair i at features i and i + D/2
        return angles.cos().to(dtype), angles.sin().to(dtype)


class ApplyRotary(CustomOp):
    """q [N, H, D] and k [N, Hkv, D] rotated with their tokens' cos, sin [N, 1, D] -> (q, k).

    `is_neox`: pair i is features (i, i + D/2), the rotate-half layout of the Llama family (GPT-NeoX's);
    False: pair i is features (2i, 2i + 1), interleaved (GPT-J's). The fused kernels rotate q and k in place,
    in one pass over both; the reference returns new tensors. Either way, use the returned pair."""

    def __init__(self, is_neox: bool = True):
        super().__init__()
        self.is_neox = is_neox

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.is_neox:
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q and k turned in place, one Triton program per token for all its heads (triton_ops.py)."""
        from roseinfer.model_executor import triton_ops

        return triton_ops.rotary(q, k, cos, sin, self.is_neox)

    def has_cuda_kernel(self) -> bool:
        return triton_importable()

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """torch.ops.roseinfer.rotary_embedding (roseinfer/csrc/rotary.cpp): q [N, H, D] and k [N, Hkv, D] (any
        row and head strides, stride 1 on D) turned in place. The dense path's [B, T, H, D] goes to the reference."""
        if not self.fits_cpu_kernel(q, k, cos):
            return self.forward_native(q, k, cos, sin)
        torch.ops.roseinfer.rotary_embedding(q, k, cos, sin, self.is_neox)
        return q, k

    def forward_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rotate q and k, then write k and v [N, Hkv, D] into the pools [num_blocks, block_size, Hkv, D] at
        `slot_mapping` [N], the layout of `write_kv_flat` (roseinfer/attention/sdpa.py). Where this module runs
        the C++ kernel, one pass does both (torch.ops.roseinfer.rotary_embedding_write_kv): each token's K row is
        copied to its slot while it is still in the L1 cache, and the two scatters of the flat write are saved."""
        if self._forward is None:
            self._forward = self.choose(q.device)
        if (self._forward == self.forward_cpu and self.fits_cpu_kernel(q, k, cos) and v.stride(-1) == 1
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype):  # fmt: skip
            torch.ops.roseinfer.rotary_embedding_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                                          self.is_neox)  # fmt: skip
            return q, k
        q, k = self(q, k, cos, sin)
        write_kv_flat(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    @staticmethod
    def fits_cpu_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        return (q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
                and q.dtype in CPU_KERNEL_DTYPES and k.dtype == q.dtype and cos.dtype == q.dtype
                and cos.dim() in (2, 3) and cos.shape[0] == q.shape[0])  # fmt: skip


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's layout: pair i is features (2i, 2i + 1), turned by angle pos · θ_i. `cos`, `sin` are the same
    [N, 1, D] tensors as the neox layout's (each θ_i's value at i and i + D/2); their first halves are used."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # [N, 1, D/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [N, H, D/2] each: the pairs' first and second features
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated pair by pair: x · cos + rotate_half(x) · sin."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim: the "-sin" and "sin" terms of each pair's rotation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
