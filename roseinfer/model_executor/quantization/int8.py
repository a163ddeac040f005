"""Int8 linear layers, written out as plain PyTorch: the reference every faster path is tested against.

A float linear y = x Wᵀ reads 4 bytes per weight (fp32). Store W as int8 with one float scale per output
channel (row of W), and it reads 1 byte: W ≈ s_w · W_q, with W_q = round(W / s_w) in [-127, 127] and
s_w = max|W_row| / 127 (symmetric: no zero point, 0.0 is exactly 0).

    W8A16  weights int8, activations float: dequantize W (s_w · W_q) then a float matmul. Saves memory and
           bandwidth, not arithmetic.
    W8A8   activations quantized too, so the matmul itself runs on int8 (AVX512-VNNI's vpdpbusd does 64
           int8 products per instruction, summed in int32):

               x ≈ s_x · x_q      s_x [N, 1]: one scale per token (dynamic: max|x_row| / 127, computed each
                                   call), or one per tensor (static: the checkpoint's `input_scale`)
               y = x Wᵀ ≈ (s_x · x_q)(s_w · W_q)ᵀ = s_x · s_wᵀ · (x_q W_qᵀ)
                                  └── scales ──┘   └ int32 ┘   [N, 1] · [1, out] · [N, out]

The int32 accumulation x_q W_qᵀ is exact (K · 127² fits easily in 31 bits), so two W8A8 kernels that agree
on x_q agree on the product bit for bit; only the float epilogue (the two multiplications) can round
differently. Names follow vLLM's: `weight`, `weight_scale`, `input_scale`, `scaled_int8_quant`,
`cutlass_scaled_mm` (here `scaled_mm`).
"""

from __future__ import annotations

import torch

INT8_MAX = 127  # symmetric: [-127, 127]; -128 is never produced, so negation never overflows


def quantize_weight(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (W_q [out, in] int8, weight_scale [out] fp32), round-to-nearest per output
    channel; with `group_size` g, one scale per g consecutive inputs of a row: weight_scale [out, in / g].
    A row (group) of zeros gets scale 1 (any scale reproduces it)."""
    w = weight.float()
    out, k = w.shape
    g = group_size or k
    if k % g:
        raise ValueError(f"group_size {g} does not divide the {k} inputs")
    scale = w.reshape(out, k // g, g).abs().amax(dim=2) / INT8_MAX  # [out, G]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w_q = torch.round(w / scale.repeat_interleave(g, dim=1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [out, in]
    return w_q, (scale if group_size else scale[:, 0])


def scaled_int8_quant(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [N, K] float -> (x_q [N, K] int8, s_x). `scale` None: dynamic, one scale per token
    (row), s_x [N, 1]; `scale` given (a static per-tensor `input_scale`): x / scale, rounded and clamped,
    s_x = scale as [1, 1]."""
    x = x.float()
    if scale is None:
        s = x.abs().amax(dim=1, keepdim=True) / INT8_MAX  # [N, 1]
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row quantizes to zeros with any scale
    else:
        s = scale.float().reshape(1, 1)  # [1, 1]
    x_q = torch.round(x / s).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [N, K]
    return x_q, s


def int8_mm_reference(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """x_q [N, K] int8 · W_qᵀ ([out, K] int8) -> [N, out] int32, the slow obvious way (widen, then matmul).
    int64 on the way: torch has no int32 matmul on every device; the sums fit in int32 exactly."""
    return (x_q.long() @ w_q.long().t()).to(torch.int32)  # [N, out]


def scaled_mm_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The float epilogue every W8A8 path shares: acc [N, out] int32 -> s_x · acc · s_w (+ bias), in fp32,
    then `out_dtype`. x_scale [N, 1] or [1, 1], weight_scale [out]."""
    y = acc.float().mul_(x_scale).mul_(weight_scale)  # [N, out] · [N, 1] · [out], in place: one new tensor
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


def w8a8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          input_scale: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float, weight [out, K] int8, weight_scale [out] -> [..., out] in x's dtype: quantize x
    (per token, or by the static `input_scale`), multiply in int8 with int32 sums, apply the scales."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [N, K]
    x_q, x_scale = scaled_int8_quant(rows, input_scale)
    acc = int8_mm_reference(x_q, weight)  # [N, out] int32
    return scaled_mm_epilogue(acc, x_scale, weight_scale, bias, x.dtype).reshape(*lead, -1)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W_q [out, K] int8 -> s_w · W_q [out, K] fp32. weight_scale [out] or [out, 1]: one scale per output
    channel; [out, G]: one per group of K / G consecutive inputs of each row (a `group_size` scheme)."""
    out, k = weight.shape
    s = weight_scale.float().reshape(out, -1)  # [out, G]
    groups = s.shape[1]
    return (weight.float().reshape(out, groups, k // groups) * s[:, :, None]).reshape(out, k)  # [out, K]


def w8a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float, weight [out, K] int8, weight_scale [out] (or [out, G], per group) -> [..., out]:
    dequantize W to x's dtype (s_w · W_q, in fp32 then rounded once), then an ordinary float linear. Only
    the weights are approximated."""
    w = dequantize_weight(weight, weight_scale).to(x.dtype)  # [out, K]
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
