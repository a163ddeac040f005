"""One small op, a readable PyTorch reference and a fused kernel per device: vLLM's `CustomOp`.

A Llama layer is two GEMM-heavy blocks (attention's projections, the MLP) glued together by element-wise work:
the residual add and RMSNorm before each block, the rotation of q and k, SiLU(gate) · up. Written in PyTorch,
each of those is several ops, and each op reads its whole input from memory and writes its whole output back:

    RMSNorm(x + residual) in PyTorch    add, float, pow, mean, add, rsqrt, mul, to, mul: ~9 passes over [N, C]
    the same, fused                     one pass: read x and residual once, write residual and the output once

So each op here is a module with three ways to run:

    forward_native(...)   the PyTorch reference: the math as transformers writes it; the oracle of the tests
    forward_cpu(...)      a fused C++ kernel of the project's extension (`roseinfer/custom_ops.py`)
    forward_cuda(...)     a fused Triton kernel

`forward` calls the one `impl` picks, decided once per module (the first call's device):

    "auto"      the fused kernel where there is one for the device (C++ built / Triton importable), else native
    "native"    the reference, always
    "compile"   the reference compiled by torch.compile (the library's answer to hand-written fusion)

`set_custom_op_impl(model, impl)` sets it on every op of a model (the engine's `custom_ops` setting).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn

from roseinfer.custom_ops import available as cpu_ops_available

IMPLS = ("auto", "native", "compile")
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the C++ ops take; fp64 runs native


class CustomOp(nn.Module):
    """Subclasses write `forward_native` and, where they have kernels, `forward_cpu` / `forward_cuda`."""

    def __init__(self) -> None:
        super().__init__()
        self.impl = "auto"
        self._forward: Callable | None = None  # chosen on the first call

    def forward(self, *args, **kwargs):
        if self._forward is None:
            self._forward = self.choose(args[0].device)
        return self._forward(*args, **kwargs)

    def set_impl(self, impl: str) -> None:
        self.impl, self._forward = check_impl(impl), None

    def choose(self, device: torch.device) -> Callable:
        """The implementation this module runs on `device`."""
        if self.impl == "native":
            return self.forward_native
        if self.impl == "compile":
            return torch.compile(self.forward_native, dynamic=True)
        if device.type == "cpu" and self.has_cpu_kernel():
            return self.forward_cpu
        if device.type == "cuda" and self.has_cuda_kernel():
            return self.forward_cuda
        return self.forward_native

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def has_cpu_kernel(self) -> bool:
        """The C++ ops are there: built (the first time) and loaded (`roseinfer/custom_ops.py`)."""
        return cpu_ops_available()

    def has_cuda_kernel(self) -> bool:
        return False


def check_impl(impl: str) -> str:
    """The `custom_ops` setting, checked: one of IMPLS (a TypeError or ValueError naming the setting otherwise)."""
    if not isinstance(impl, str):
        raise TypeError(f"custom_ops must be one of {IMPLS}, got {impl!r}")
    if impl not in IMPLS:
        raise ValueError(f"unknown custom_ops {impl!r}; use one of {IMPLS}")
    return impl


def set_custom_op_impl(model: nn.Module, impl: str) -> None:
    """Every CustomOp of `model` runs `impl` ("auto" | "native" | "compile") from its next call on."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.set_impl(impl)


@functools.cache
def triton_importable() -> bool:
    """Whether the Triton kernels of `forward_cuda` can load (triton_ops.py imports triton); asked once, on a
    CUDA tensor's first call only, so CPU runs never import triton."""
    try:
        from roseinfer.model_executor import triton_ops  # noqa: F401
    except ImportError:
        return False
    return True
