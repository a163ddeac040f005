"""The MLP's activation function, by the name a Hugging Face `config.json` gives it.

GPT-2 uses `gelu_new` (GELU with the tanh approximation), but `activation_function` may
name any entry of transformers' `ACT2FN` table. The names below mean exactly what they
mean there; names that are spellings of the same function share one entry. Two entries
of `ACT2FN` carry learned weights (`prelu`, `xielu`), which GPT-2's MLP never loads, so
they are refused, as is any name we do not know.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from roseinfer.model_executor.custom_op import CPU_KERNEL_DTYPES, CustomOp, triton_importable

Activation = Callable[[torch.Tensor], torch.Tensor]

gelu_tanh: Activation = lambda x: F.gelu(x, approximate="tanh")  # 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))

ACTIVATIONS: dict[str, Activation] = {
    # GELU, tanh approximation: GPT-2's own, under five names
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_python_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu_accurate": gelu_tanh,
    # exact GELU: x·Φ(x), with the erf
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_10": lambda x: F.gelu(x).clamp(-10, 10),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,  # negative slope 0.01
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "linear": lambda x: x,
}
WITH_WEIGHTS = ("prelu", "xielu")  # in ACT2FN, but they have parameters of their own


def get_activation(name: str) -> Activation:
    """The function for `activation_function=name`; a ValueError for anything else."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    why = "it has learned weights that a GPT-2 checkpoint does not hold" if name in WITH_WEIGHTS else "unknown name"
    raise ValueError(f"activation_function={name!r} is not supported ({why}); use one of {sorted(ACTIVATIONS)}")


class SiluAndMul(CustomOp):
    """SwiGLU's gate: x [..., 2I] = [gate | up] -> silu(gate) · up [..., I] (vLLM's `SiluAndMul`).

    In PyTorch that is a chunk, a SiLU that writes [..., I], and a product that reads it back; the fused
    kernels read each gate and up value once and write the product once."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2I] -> [..., I] in one Triton kernel (triton_ops.py)."""
        from roseinfer.model_executor import triton_ops

        return triton_ops.silu_and_mul(x)

    def has_cuda_kernel(self) -> bool:
        return triton_importable()

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """torch.ops.roseinfer.silu_and_mul (roseinfer/csrc/activation.cpp): x [..., 2I] -> a new [..., I]."""
        if x.dim() == 0 or x.stride(-1) != 1 or x.dtype not in CPU_KERNEL_DTYPES:
            return self.forward_native(x)
        if x.dim() == 2:  # the model's [N, 2I]
            out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)  # [N, I]
            torch.ops.roseinfer.silu_and_mul(out, x)
            return out
        rows = x.reshape(-1, x.shape[-1])  # [N, 2I]: a view where the leading dims are contiguous, else a copy
        out = torch.empty((rows.shape[0], rows.shape[1] // 2), dtype=x.dtype)
        torch.ops.roseinfer.silu_and_mul(out, rows)
        return out.view(*x.shape[:-1], -1)


class NewGELU(CustomOp):
    """GPT-2's GELU, tanh form (vLLM's `NewGELU`): 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³).

    PyTorch's CPU kernel calls an accurate vectorised tanh, ~1.9 ns an element on this CPU (6.7% of a W8A8 GPT-2
    run, where no GEMM carries the GELU as a post-op). The C++ op computes the same function as x / (1 + exp(-2u))
    (0.5·(1 + tanh u) is the logistic function of 2u) on the exp SiLU uses: ~4× faster, equal to PyTorch's to a
    few fp32 ulps. On CUDA the reference, one PyTorch kernel already."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """torch.ops.roseinfer.gelu_new (roseinfer/csrc/activation.cpp): x [..., C] -> a new [..., C]."""
        if x.dim() == 0 or x.stride(-1) != 1 or x.dtype not in CPU_KERNEL_DTYPES:
            return self.forward_native(x)
        rows = x.reshape(-1, x.shape[-1])  # [N, C]: a view where the leading dims are contiguous, else a copy
        out = torch.empty(rows.shape, dtype=x.dtype)  # [N, C]
        torch.ops.roseinfer.gelu_new(out, rows)
        return out.view(x.shape)
