"""RMSNorm, and the residual add before it, as one op (vLLM's `RMSNorm(x, residual)`).

    RMSNorm(x) = x / √(mean(x²) + ε) · weight        no mean subtracted, no bias (computed in fp32)

A Llama layer adds each block's output to the residual stream and normalises the sum for the next block:

    residual = x + residual                           what transformers writes as `hidden = residual + hidden`
    x        = RMSNorm(residual)

Called with a residual, the op does both and returns (x, residual): the fused kernels read the two inputs
once and write the two outputs once, *in place* (vLLM's contract: the sum goes into `residual`, the normalised
row into `x`; the reference returns new tensors). Without one it is the plain RMSNorm (a model's first layer;
Qwen3's norm over each head of q and k, where x is a strided [N, H, D] view of the qkv output: the C++ kernel
reads it where it lies, a row per head).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from roseinfer.model_executor.custom_op import CPU_KERNEL_DTYPES, CustomOp, triton_importable


class RMSNorm(CustomOp):
    """x [..., C] -> RMSNorm(x); with `residual` [..., C]: (RMSNorm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual  # the sum in the model's dtype, as transformers adds
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One Triton program per row (triton_ops.py); with a residual, x and residual are overwritten."""
        from roseinfer.model_executor import triton_ops

        return triton_ops.rms_norm(x, self.weight, self.eps, residual)

    def has_cuda_kernel(self) -> bool:
        return triton_importable()

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """torch.ops.roseinfer.rms_norm / fused_add_rms_norm (roseinfer/csrc/layernorm.cpp) for x [N, C] or
        [A, B, C] with stride 1 on C, in the weight's dtype; anything else goes to the reference."""
        if not self._fits(x) or (residual is not None and not self._fits(residual, x)):
            return self.forward_native(x, residual)
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., C], contiguous
            torch.ops.roseinfer.rms_norm(out, x, self.weight, self.eps)
            return out
        torch.ops.roseinfer.fused_add_rms_norm(x, residual, self.weight, self.eps)  # both written in place
        return x, residual

    def _fits(self, t: torch.Tensor, like: torch.Tensor | None = None) -> bool:
        like = t if like is None else like
        return (t.dim() in (2, 3) and t.stride(-1) == 1 and t.dtype in CPU_KERNEL_DTYPES
                and t.dtype == self.weight.dtype and t.shape == like.shape)  # fmt: skip
