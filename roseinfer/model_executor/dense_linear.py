"""Float linear layers through the project's own GEMM (csrc/dense_gemm.cpp), on a CPU with AVX-512, fp32 or bf16.

    load time:  W [out, in] ── pack_dense_weight ──► panels [P, Kp, 64, E]: 64 outputs by E inputs per row
                                                     (E = 1 in fp32, 2 in bf16: the pair vdpbf16ps multiplies)
    each step:  x [N, in] ── dense_linear ──► x Wᵀ + b [N, out]    (F.linear is the reference)

The kernel is int8_gemm.cpp's loop on floats: a tile of 6 rows by 64 outputs held in 24 registers while the
inputs stream past, the threads splitting the panels. Why write a GEMM when oneDNN's is at hand
(onednn_linear.py)? In the engine each layer's weights come from memory: a decode step reads all 30 layers'
weights once for 32 rows, and in that setting this loop measured faster than oneDNN's packed linear at every row
count from 1 to 200 (SmolLM2's shapes, chapter 20, section 9.9), most at a decode step's few rows. It needs no
row buckets either: it builds nothing per shape, so any row count is one call.

The sums are fp32, as in oneDNN's, but in another order, so the results agree with F.linear to rounding, not bit
for bit (the tests bound the difference; greedy output still matches transformers in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roseinfer.custom_ops import available as cpu_ops_available

PANEL = 64  # output columns per panel (csrc/dense_gemm.cpp)
PACK = {torch.float32: 1, torch.bfloat16: 2}  # inputs per packed step: E


@dataclass(frozen=True)
class DenseWeight:
    """A linear layer's weight packed for `dense_gemm`; `out_features` is W's row count (the panels hold whole
    multiples of 64, zero-padded)."""

    panels: torch.Tensor  # [P, Kp, 64, E]
    out_features: int


def dense_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel runs here: a CPU, fp32 or bf16, the C++ ops built, and the instructions (AVX-512; AVX512-BF16
    for bf16) in this build (the op says so itself)."""
    if device.type != "cpu" or dtype not in PACK or not cpu_ops_available():
        return False
    return bool(torch.ops.roseinfer.dense_gemm_available(dtype))


def pack_dense_weight(weight: torch.Tensor) -> DenseWeight:
    """weight [out, K] -> panels[p, kp, c, e] = weight[64 p + c, E kp + e], zero-padded to whole panels of 64
    outputs and E inputs, so one 64-byte load holds one step's inputs of 16 outputs."""
    out, k = weight.shape
    e = PACK[weight.dtype]
    padded = F.pad(weight.detach(), (0, -k % e, 0, -out % PANEL))  # [P * 64, Kp * E]
    panels = padded.reshape(-1, PANEL, padded.shape[1] // e, e).permute(0, 2, 1, 3).contiguous()  # [P, Kp, 64, E]
    return DenseWeight(panels, out)


def dense_linear(x: torch.Tensor, weight: DenseWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> x Wᵀ + b [..., out] through the packed W, in x's dtype."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1]).contiguous()  # [N, in]
    out = rows.new_empty(rows.shape[0], weight.out_features)  # [N, out]
    torch.ops.roseinfer.dense_gemm(out, rows, weight.panels, bias)
    return out.reshape(*lead, weight.out_features)
