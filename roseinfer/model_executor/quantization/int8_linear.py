"""The int8 linear layers the model runs (W8A8: Int8Linear; W8A16: Int8WeightOnlyLinear) and their fast
paths (the references are int8.py).

W8A8:

On a CPU:
    load time:  weight [out, K] int8 ── .t() ──► weight_t [K, out], a view (what torch._int_mm reads)
                weight ── pack_int8_weight ──► vnni_weight: panels of 64 outputs x 4 inputs (what int8_gemm reads)
    each step:  x [N, K] float ── quantize_activations ──► x_q [N, K] int8, s_x (per token: one C++ pass
                                                            per row, csrc/int8_quant.cpp, where it is built)
      with AVX512-VNNI (any number of rows: decode, prefill, a step of both):
                x_q · vnni_weight ── int8_gemm ──► [N, out] in x's dtype (csrc/int8_gemm.cpp: vpdpbusd on the
                                                   weight packed once, the epilogue fused)
      without it (or without the C++ ops):
                x_q · weight_t ── torch._int_mm ──► [N, out] int32 (oneDNN's s8·s8 -> s32 gemm,
                                                    ONEDNN_VERBOSE=1 shows it: gemm_api, ISA "AVX-512
                                                    with Intel DL Boost", i.e. VNNI)
                s_x · acc · s_w (+ bias) ──► [N, out] in x's dtype (mm_epilogue: one C++ pass over acc,
                                              csrc/int8_quant.cpp, instead of PyTorch's four)

On CUDA, with triton importable (triton_int8.py; never run on a GPU, tested in Triton's interpreter):
    load time:  weight_t = weight.t(), a view: the kernel reads weight [out, K] as it is, K contiguous
    each step:  x ── _int8_quant_kernel ──► x_q, s_x ── _scaled_mm_kernel ──► [N, out]: two launches, the
                int32 product stays in registers, any number of rows

The integer product is exact, so both paths equal `w8a8_linear_reference` up to the float epilogue (the
tests check it). `torch._int_mm` exists on CPU and CUDA in torch 2.13; cuBLAS needs more than 16 rows, so
smaller CUDA batches without triton take the reference GEMM. oneDNN's gemm packs the weight on every call,
as MKL's sgemm does for fp32 (onednn_linear.py). int8_gemm reads a weight packed once, at load time: faster at
a decode step's rows, 0-20% apart from 128 rows on with one layer's weight in cache, and a W8A8 SmolLM2 run
8-11% faster once the 50-250 rows of its mixed steps (a new prompt beside the running sequences' decode rows)
took it too, where each weight comes from memory (chapter 22, section 9.7).

W8A16 (weights int8, activations stay float): y = x · (s_w · W_q)ᵀ. Per weight it stores and reads 1 byte
instead of 4 (fp32) or 2 (bf16): memory and bandwidth, which is what decode is bound by. It saves no
arithmetic: every product is still a float multiply-add, and the int8 weight must first become a float.
Two ways to run it on a CPU, measured on SmolLM2-135M's shapes (576×1536, one thread):

    aten._weight_int8pack_mm(x, W_q, s_w)   one kernel that converts each int8 weight as it multiplies;
                                            bf16: fast for a few rows (1 row: ~50 µs, 7× faster than dequantizing,
                                            faster even than the bf16 linear of the float weight), slower from
                                            ~32 rows on (256 rows: 2.4× slower); fp32 and fp16: a slow
                                            generic loop (1 row: 3.5× slower, 256 rows: 38× slower)
    dequantize, then F.linear               s_w · W_q in fp32 (a new [out, K] tensor each call), then the
                                            ordinary float GEMM (MKL/oneDNN): the GEMM's cost plus one pass
                                            over the weight; for many rows that pass is noise

`w8a16_linear` takes the first for bf16 batches of up to 16 rows (decode) with one scale per channel, and
the second (exactly `w8a16_linear_reference`) everywhere else, including group scales.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from roseinfer.custom_ops import available as cpu_ops_available
from roseinfer.model_executor.quantization.int8 import (
    int8_mm_reference,
    scaled_int8_quant,
    scaled_mm_epilogue,
    w8a8_linear_reference,
    w8a16_linear_reference,
)

INT8PACK_MAX_ROWS = 16  # _weight_int8pack_mm (bf16) beats dequantize + F.linear up to here (measured above)
EPILOGUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the C++ epilogue writes
PANEL = 64  # output columns per panel of the packed weight (csrc/int8_gemm.cpp)


def int8_mm(x_q: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x_q [N, K] int8 · weight_t [K, out] int8 -> [N, out] int32, through torch._int_mm."""
    if x_q.device.type == "cuda" and x_q.shape[0] <= 16:  # cuBLAS' int8 GEMM needs more than 16 rows
        return int8_mm_reference(x_q, weight_t.t())
    return torch._int_mm(x_q, weight_t)


@functools.cache
def vnni_gemm_available() -> bool:
    """Whether csrc/int8_gemm.cpp was built with AVX512-VNNI (its op says so itself)."""
    return cpu_ops_available() and torch.ops.roseinfer.int8_gemm_available()


def pack_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, K] int8 -> (packed [P, K4, 64, 4] int8, comp [P * 64] int32), what `int8_gemm` reads:
    packed[p, k4, c, j] = weight[64 p + c, 4 k4 + j], zero-padded to whole panels of 64 outputs and 4 inputs,
    so one 64-byte load holds 4 inputs of 16 outputs (a VNNI instruction's operand); comp = 128 · each row's
    sum, what the kernel's unsigned x (x + 128) adds to every output and must take off."""
    out, k = weight.shape
    padded = F.pad(weight, (0, -k % 4, 0, -out % PANEL))  # [P * 64, K4 * 4]
    packed = padded.reshape(-1, PANEL, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()  # [P, K4, 64, 4]
    comp = 128 * padded.sum(dim=1, dtype=torch.int32)  # [P * 64]
    return packed, comp


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`scaled_int8_quant`, with the dynamic per-token case on the C++ op on a CPU (bit-equal to it)."""
    if input_scale is None and x.device.type == "cpu" and x.stride(-1) == 1 and cpu_ops_available():
        x_q = torch.empty(x.shape, dtype=torch.int8)  # [N, K]
        scale = torch.empty(x.shape[0], 1)  # [N, 1] fp32
        torch.ops.roseinfer.dynamic_scaled_int8_quant(x_q, x, scale)
        return x_q, scale
    return scaled_int8_quant(x, input_scale)


def fused_epilogue_ok(x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether the C++ epilogue (csrc/int8_epilogue.h) takes these: fp32 scales, a bias in the output's dtype."""
    scales = x_scale.dtype == weight_scale.dtype == torch.float32
    return out_dtype in EPILOGUE_DTYPES and scales and (bias is None or bias.dtype == out_dtype)


def mm_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`scaled_mm_epilogue`, in one C++ pass on a CPU (bit-equal to it): acc [N, out] int32 -> [N, out]."""
    on_cpu_ops = acc.device.type == "cpu" and cpu_ops_available()
    if not (on_cpu_ops and fused_epilogue_ok(x_scale, weight_scale, bias, out_dtype)):
        return scaled_mm_epilogue(acc, x_scale, weight_scale, bias, out_dtype)
    out = torch.empty(acc.shape, dtype=out_dtype)  # [N, out]
    torch.ops.roseinfer.int8_scaled_mm_epilogue(out, acc, x_scale.contiguous(), weight_scale.contiguous(), bias)
    return out


@functools.cache
def triton_int8_importable() -> bool:
    """Whether triton_int8.py's kernels can load; asked on CUDA only, so CPU runs never import triton."""
    try:
        from roseinfer.model_executor.quantization import triton_int8  # noqa: F401
    except ImportError:
        return False
    return True


def w8a8_linear(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                vnni_weight: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float -> [..., out]: the same math as `w8a8_linear_reference`. weight_t = weightᵀ [K, out],
    laid out at load time. On CUDA with triton: the two Triton kernels, which read weight_t.t() = weight
    [out, K] through its strides; on a CPU with `vnni_weight` (pack_int8_weight's): the VNNI GEMM with the epilogue
    fused, at any number of rows; otherwise the integer GEMM on torch._int_mm."""
    if x.is_cuda and triton_int8_importable():
        from roseinfer.model_executor.quantization.triton_int8 import w8a8_linear_triton

        return w8a8_linear_triton(x, weight_t.t(), weight_scale, input_scale, bias)
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [N, K]
    x_q, x_scale = quantize_activations(rows, input_scale)
    if vnni_weight is not None and fused_epilogue_ok(x_scale, weight_scale, bias, x.dtype):
        out = torch.empty(rows.shape[0], weight_scale.numel(), dtype=x.dtype)  # [N, out]
        x_scale, weight_scale = x_scale.contiguous(), weight_scale.contiguous()
        torch.ops.roseinfer.int8_gemm(out, x_q.contiguous(), *vnni_weight, x_scale, weight_scale, bias)
        return out.reshape(*lead, -1)
    acc = int8_mm(x_q, weight_t)  # [N, out] int32
    return mm_epilogue(acc, x_scale, weight_scale, bias, x.dtype).reshape(*lead, -1)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float, weight [out, K] int8, weight_scale [out] (per channel) or [out, G] (per group) ->
    [..., out]: `_weight_int8pack_mm` for small bf16 batches on a CPU, else `w8a16_linear_reference`."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [N, K]
    fast = x.dtype == torch.bfloat16 and x.device.type == "cpu" and weight_scale.dim() == 1
    if not (fast and rows.shape[0] <= INT8PACK_MAX_ROWS):
        return w8a16_linear_reference(x, weight, weight_scale, bias)
    y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight, weight_scale.to(x.dtype))  # [N, out]
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*lead, -1)


class _Int8Weights(nn.Module):
    """What both int8 layers share: `.to(dtype)` casts the model's float tensors (the bias); the int8 weight
    and the fp32 scales keep theirs."""

    def _apply(self, fn, recurse=True):
        keep = {n: p.data for n, p in self.named_parameters(recurse=False) if n != "bias"}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            p = getattr(self, name)
            p.data = old.to(p.device)
        return self


class Int8Linear(_Int8Weights):
    """y = x Wᵀ + b with W stored as int8 + a per-output-channel scale (compressed-tensors' W8A8 int8 scheme;
    vLLM's CompressedTensorsW8A8Int8). Its state dict holds the checkpoint's tensors as they are saved:
    `weight` [out, in] int8, `weight_scale` [out, 1], and `input_scale` [1] when activations are static."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, static_input: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, 1), requires_grad=False)  # [out, 1] fp32
        self.input_scale = nn.Parameter(torch.ones(1), requires_grad=False) if static_input else None
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None  # [in, out] int8, made by process_weights_after_loading
        self.vnni_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # pack_int8_weight's, CPU with VNNI
        self.use_reference = False  # True: the plain-PyTorch reference (int8.py) instead of the fast path

    def process_weights_after_loading(self) -> None:
        """Lay the weight out as the GEMMs read it (vLLM's name for this load-time step). weight_t: a transposed
        view, no copy, for the Triton kernel (CUDA) and for torch._int_mm on a CPU (oneDNN packs it on every call
        anyway: a contiguous copy measured no faster); a [in, out] copy for cuBLAS. On a CPU with VNNI, also the
        panels int8_gemm reads: a second byte per weight, a bf16 model's count."""
        if self.weight.is_cuda and not triton_int8_importable():
            self.weight_t = self.weight.data.t().contiguous()  # [in, out]
        else:
            self.weight_t = self.weight.data.t()  # [in, out] view, strides (1, in)
        if self.weight.device.type == "cpu" and vnni_gemm_available():
            self.vnni_weight = pack_int8_weight(self.weight.data)  # what int8_gemm reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_scale.reshape(-1)  # [out]
        if self.use_reference or self.weight_t is None:
            return w8a8_linear_reference(x, self.weight, scale, self.input_scale, self.bias)
        return w8a8_linear(x, self.weight_t, scale, self.input_scale, self.bias, self.vnni_weight)


class Int8WeightOnlyLinear(_Int8Weights):
    """y = x Wᵀ + b with W stored as int8 + float scales and x left as it is (compressed-tensors' W8A16 int8
    scheme; vLLM's CompressedTensorsWNA16 with 8 bits). Its state dict: `weight` [out, in] int8 (the loader
    unpacks the checkpoint's `weight_packed`, compressed_tensors.py) and `weight_scale` [out, 1] fp32, or
    [out, in / group_size] with `group_size` (one scale per group of inputs)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None):
        super().__init__()
        if group_size is not None and (group_size <= 0 or in_features % group_size):
            raise ValueError(f"quantization_config weights.group_size={group_size} does not divide a linear "
                             f"layer's {in_features} inputs")  # fmt: skip
        groups = 1 if group_size is None else in_features // group_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, groups), requires_grad=False)  # [out, G] fp32
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.use_reference = False  # True: w8a16_linear_reference always

    def process_weights_after_loading(self) -> None:
        """Nothing to lay out: _weight_int8pack_mm reads `weight` [out, in] as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_scale if self.weight_scale.shape[1] > 1 else self.weight_scale.reshape(-1)  # [out]
        if self.use_reference:
            return w8a16_linear_reference(x, self.weight, scale, self.bias)
        return w8a16_linear(x, self.weight, scale, self.bias)
