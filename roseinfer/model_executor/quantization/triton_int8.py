"""W8A8 on a GPU in Triton: per-token int8 quantization of x, and the int8 GEMM with its scales fused in.

Never run on a GPU: both kernels are tested on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`,
tests/test_22_triton_int8.py) against the references of int8.py, and compiled ahead of time for sm_80 and
sm_90 by tools/triton_aot.py (their launches are listed in roseinfer/attention/triton_registry.py).

    x [N, K] float ── _int8_quant_kernel ──► x_q [N, K] int8, s_x [N, 1] fp32 (or the static [1, 1])
    x_q, W_q [out, K] int8 ── _scaled_mm_kernel ──► [N, out] in x's dtype = s_x · (x_q W_qᵀ) · s_w (+ bias)

The quantization (vLLM's `scaled_int8_quant`): one program per row, two passes over it in tiles of BLOCK
columns, the first for max|x|, the second to divide, round and clamp. It is bit-equal to the reference: the
max is exact, both divisions are IEEE's round-to-nearest (`tl.div_rn`; a plain `/` may compile to an
approximate division), and rounding is half to even as `torch.round` does (see `_round_half_even`).

The GEMM (vLLM's `triton_scaled_mm`; `cutlass_scaled_mm` in its CUDA build). The grid tiles the output, and
program (m, n) computes tile ■ from a band of BLOCK_M rows of x_q (→) and a band of BLOCK_N columns of W_qᵀ (↓):

                 K                       out                          out
        ┌─────────────────┐       ┌────┬────┬────┐            ┌────┬────┬────┐
        │                 │       │    │ ↓  │    │            │    │    │    │
     N  ├─────────────────┤   ×   │    │ ↓  │    │ K    =   N ├────┼────┼────┤
        │ → → → → → → → → │ BM    │    │ ↓  │    │            │    │ ■  │    │ BM
        ├─────────────────┤       │    │ ↓  │    │            ├────┼────┼────┤
        └─────────────────┘       └────┴────┴────┘            └────┴────┴────┘
            x_q [N, K]              W_qᵀ [K, out]                out [N, out]

Program (m, n) walks K in steps of BLOCK_K: it loads a [BLOCK_M, BLOCK_K] tile of x_q and a [BLOCK_K, BLOCK_N]
tile of W_qᵀ (read out of W_q [out, K] itself, whose rows are K-contiguous: the layout int8 tensor cores take,
so no transposed copy of the weight is ever made) and adds their product to an int32 [BLOCK_M, BLOCK_N]
accumulator: `tl.dot` on int8 with `out_dtype=tl.int32`, the tensor cores' s8·s8 -> s32 MMA (in the PTX of
`tools/triton_aot.py --ptx`: mma.sync m16n8k32 s32.s8.s8.s32 on sm_80, wgmma m64n64k32 s32.s8.s8 on sm_90).
Lanes past N, out or K load 0, which adds nothing, so any N (1 token included: cuBLAS's int8 GEMM wants more
than 16 rows) and any K work. The sums are exact: |x_q · w_q| <= 127² per product, K · 127² < 2³¹ for K < 133 000.

Only then the epilogue, once per output element, in fp32 and in the reference's order:
acc · s_x[row] · s_w[col] (+ bias[col]), stored in the output's dtype. One launch reads x_q and W_q once and
writes the output once; the int32 product never goes to memory (the torch._int_mm path writes it and reads it
back). Stored as int32 (an int32 `out`), the raw accumulator comes out instead: the tests compare it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q_MAX = tl.constexpr(127.0)  # int8.py's INT8_MAX: -128 is never produced (a constexpr: the kernels read it)

# --------------------------------------------------------------------------------------------------
# 1. Per-token dynamic (or static per-tensor) int8 quantization of the activations
# --------------------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(y):
    """fp32 -> the nearest integer (as fp32), ties to even, as torch.round. Adding 1.5·2²³ leaves no bits for a
    fraction in fp32's 23-bit mantissa, so the add's own round-to-nearest-even rounds y; subtracting gives the
    integer back. Exact for |y| < 2²²; a larger |y| comes back large with its sign, and is clamped to ±127 after.
    (libdevice's rint would be one instruction, but Triton's interpreter cannot run libdevice.)"""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _int8_quant_kernel(
    x_ptr,  # [N, K] float (last dim contiguous)
    x_q_ptr,  # [N, K] int8, out
    scale_ptr,  # dynamic: [N] fp32, out (s_x of each row); static: [1] fp32, in (input_scale)
    stride_xn,  # elements between two rows of x
    stride_qn,  # elements between two rows of x_q
    n_cols,  # K: a runtime value, any size
    STATIC: tl.constexpr,  # True: divide by the given scale; False: compute each row's
    BLOCK: tl.constexpr,  # columns per tile, a power of two
):
    # The grid is (N,): one program quantizes one row (one token).
    row = tl.program_id(0).to(tl.int64)  # int64 so `row * stride` cannot overflow
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    if STATIC:
        s = tl.load(scale_ptr)  # the checkpoint's input_scale, the same for every row
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)  # [BLOCK] running max|x| of each lane
        for start in range(0, n_cols, BLOCK):  # pass 1: max|x| over the row
            mask = start + cols < n_cols
            x = tl.load(x_ptr + row * stride_xn + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.div_rn(tl.max(amax, axis=0), Q_MAX)  # a scalar: max|x| / 127, rounded as torch divides
        s = tl.where(s > 0, s, 1.0)  # an all-zero row: any scale quantizes it to zeros; the reference takes 1
        tl.store(scale_ptr + row, s)
    for start in range(0, n_cols, BLOCK):  # pass 2 (or the only pass): x / s, rounded, clamped to ±127
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * stride_xn + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(_round_half_even(tl.div_rn(x, s)), -Q_MAX, Q_MAX)  # [BLOCK] integers, as fp32
        tl.store(x_q_ptr + row * stride_qn + start + cols, q.to(tl.int8), mask=mask)


_QUANT_BLOCK = 1024  # columns per tile at most: 128 threads x 8 fp32 values


def int8_quant_triton(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] float -> (x_q [N, K] int8, s_x): `scaled_int8_quant`'s values, bit for bit. `scale` None:
    dynamic, s_x [N, 1] fp32; `scale` given (a static per-tensor input_scale): s_x = scale as [1, 1]."""
    assert x.dim() == 2, "x must be [N, K]"
    x = x if x.stride(-1) == 1 else x.contiguous()
    N, K = x.shape
    x_q = torch.empty((N, K), dtype=torch.int8, device=x.device)  # [N, K]
    if scale is None:
        s_x = torch.empty((N, 1), dtype=torch.float32, device=x.device)  # [N, 1], one per row
    else:
        s_x = scale.to(device=x.device, dtype=torch.float32).reshape(1, 1)  # [1, 1]
    if N > 0 and K > 0:
        _int8_quant_kernel[(N,)](
            x, x_q, s_x, x.stride(0), x_q.stride(0), K,
            STATIC=scale is not None, BLOCK=min(_QUANT_BLOCK, triton.next_power_of_2(K)),
        )  # fmt: skip
    elif scale is None:
        s_x.fill_(1.0)  # an empty row (K = 0) is all zeros: scale 1, as the reference
    return x_q, s_x


# --------------------------------------------------------------------------------------------------
# 2. The int8 GEMM with the scales (and bias) in its epilogue
# --------------------------------------------------------------------------------------------------


@triton.jit
def _scaled_mm_kernel(
    out_ptr,  # [N, out]: float (the scaled product) or int32 (the raw accumulator)
    x_q_ptr,  # [N, K] int8 (last dim contiguous)
    w_ptr,  # [out, K] int8, W_q: read through its strides (any layout works; K-contiguous is the fast one)
    x_scale_ptr,  # [N] fp32 (per token) or [1] (per tensor)
    w_scale_ptr,  # [out] fp32, s_w
    bias_ptr,  # [out] float (unused without HAS_BIAS)
    M,  # N, the rows (tokens)
    N,  # out, the output channels
    K,
    stride_xm,  # elements between two rows of x_q
    stride_wn,  # elements between two output channels of W_q
    stride_wk,  # elements between two columns (k) of W_q: 1 for a contiguous [out, K] weight
    stride_om,  # elements between two rows of out
    PER_TOKEN: tl.constexpr,  # True: x_scale has one value per row; False: one for the whole tensor
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile (>= 16: tl.dot's smallest)
    BLOCK_N: tl.constexpr,  # output channels per tile
    BLOCK_K: tl.constexpr,  # the step along K (>= 32 for int8 MMA)
):
    # The grid is (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): program (pid_m, pid_n) computes one output tile.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] token indices
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channel indices
    ks = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < M  # [BM]
    col_ok = cols < N  # [BN]

    # [BM, 1] + [1, BK] -> [BM, BK] pointers into x_q; [BK, 1] + [1, BN] -> [BK, BN] pointers into W_q, which
    # read it as W_qᵀ: element (k, n) of the tile is W_q[n, k].
    x_ptrs = x_q_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)  # [BM, BN] exact integer sums
    for start in range(0, K, BLOCK_K):
        k_ok = start + ks < K  # [BK] the last step may hang over the end of K: those lanes load 0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)  # [BM, BK] int8
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BK, BN] int8
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # [BM, BN] += a @ b, s8·s8 -> s32 on the tensor cores
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]  # [BM, BN]
    mask = row_ok[:, None] & col_ok[None, :]
    if out_ptr.dtype.element_ty == tl.int32:  # the raw product, for the tests: no epilogue
        tl.store(out_ptrs, acc, mask=mask)
    else:
        if PER_TOKEN:
            s_x = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]  # [BM, 1]
        else:
            s_x = tl.load(x_scale_ptr)  # a scalar
        s_w = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]  # [1, BN]
        y = acc.to(tl.float32) * s_x * s_w  # [BM, BN] the reference's order: (acc · s_x) · s_w
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows. A decode step (few rows) is a matrix-vector product
    bound by reading W_q: a short row tile (no idle rows to multiply) and narrow column tiles, so that many
    programs share the weight's bytes out over the SMs. A prefill (many rows) reuses each W_q tile over 128 rows.
    Chosen by reasoning, not tuned: nothing here has been timed on a GPU."""
    if M <= 64:
        return max(16, triton.next_power_of_2(M)), 64, 128, 4
    return 128, 128, 64, 8


def scaled_mm_triton(
    x_q: torch.Tensor,  # [N, K] int8
    weight: torch.Tensor,  # [out, K] int8, any strides (weight_t.t() of a [K, out] tensor works too)
    x_scale: torch.Tensor,  # [N, 1] or [1, 1] fp32
    weight_scale: torch.Tensor,  # [out] fp32
    bias: torch.Tensor | None,  # [out]
    out_dtype: torch.dtype,  # torch.int32: the raw accumulator x_q W_qᵀ, no epilogue
) -> torch.Tensor:
    """s_x · (x_q W_qᵀ) · s_w (+ bias) -> [N, out] in `out_dtype`: int8.py's `int8_mm_reference` followed by
    `scaled_mm_epilogue`, in one launch."""
    assert x_q.dtype == torch.int8 and weight.dtype == torch.int8, "x_q and weight must be int8"
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    (M, K), N = x_q.shape, weight.shape[0]
    assert weight.shape == (N, K), f"weight {tuple(weight.shape)} does not fit x_q [{M}, {K}]"
    assert x_scale.numel() in (1, M) and weight_scale.numel() == N, "x_scale [N, 1] or [1, 1], weight_scale [out]"
    out = torch.empty((M, N), dtype=out_dtype, device=x_q.device)  # [N, out]
    if M == 0 or N == 0:
        return out
    x_scale = x_scale.reshape(-1).float().contiguous()  # [N] or [1]
    weight_scale = weight_scale.reshape(-1).float().contiguous()  # [out]
    block_m, block_n, block_k, warps = _tiles(M)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _scaled_mm_kernel[grid](
        out, x_q, weight, x_scale, weight_scale, weight_scale if bias is None else bias,
        M, N, K, x_q.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        PER_TOKEN=x_scale.numel() > 1, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


def w8a8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float, weight [out, K] int8 -> [..., out] in x's dtype: `w8a8_linear_reference`'s math in two
    launches (quantize x, then the GEMM with its epilogue)."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [N, K]
    x_q, x_scale = int8_quant_triton(rows, input_scale)
    return scaled_mm_triton(x_q, weight, x_scale, weight_scale, bias, x.dtype).reshape(*lead, weight.shape[0])
