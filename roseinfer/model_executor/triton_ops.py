"""The small ops of a Llama layer as Triton kernels: the `forward_cuda` of RMSNorm, ApplyRotary and SiluAndMul.

Never run on a GPU: these kernels are tested on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`,
tests/test_20_triton_fused_ops.py) against each op's `forward_native`, and compiled ahead of time for sm_80
and sm_90 by tools/triton_aot.py (their launches at model shapes are in roseinfer/attention/triton_registry.py).

Each op is memory-bound: a few flops per element, so its time is the bytes it moves. In PyTorch every step of
the math is its own kernel that reads its input from memory and writes its output back (custom_op.py counts
~9 passes for RMSNorm with the residual add). Fused, each kernel reads its inputs once and writes its outputs
once, and keeps the steps in between in registers, in fp32 whatever the tensors' dtype:

    rms_norm          one program per row:   residual = x + residual (in x's dtype, as the model adds),
                                             out = weight · (residual / √(mean(residual²) + ε)).to(dtype)
                      with a residual both are written in place, out into x: vLLM's fused_add_rms_norm
    rotary            one program per token: every head of its q and of its k turned in place, pair by pair
    silu_and_mul      one program per (row, tile of I columns): silu(gate) · up, [..., 2I] -> [..., I]

Rows may be strided views (q and k are slices of the fused qkv output): the launchers pass strides, and copy
only a tensor whose rows no stride can describe (then the returned tensor is the copy: use what they return).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------
# 1. RMSNorm, with the residual add before it
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R1, R2, C] the normalised rows (x itself when the op runs in place)
    x_ptr,  # [R1, R2, C] the block's output (with a residual) or the rows to normalise
    residual_ptr,  # [R1, R2, C] the residual stream, overwritten by x + residual (unused without one)
    weight_ptr,  # [C]
    stride_o1,  # elements between two rows of out along R1 ...
    stride_o2,  # ... and along R2 (a row's C elements are contiguous in every tensor)
    stride_x1,
    stride_x2,
    stride_r1,
    stride_r2,
    n_cols,  # C, the width of a row: a runtime value, any size
    eps,
    HAS_RESIDUAL: tl.constexpr,  # False compiles the add and the residual's store away
    BLOCK: tl.constexpr,  # C rounded up to a power of two: one tile holds the whole row
):
    # The grid is (R1, R2): one program normalises one row. Rows are indexed in two levels so that q [N, H, D],
    # a view into the fused qkv output (rows H·D apart within a token, qkv's width apart across tokens), needs
    # no copy; an ordinary [N, C] tensor is R2 = 1.
    r1 = tl.program_id(0).to(tl.int64)  # int64 so `r1 * stride` cannot overflow on long prompts
    r2 = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n_cols  # lanes past C read 0 and write nothing: they add 0 to the sum of squares

    x = tl.load(x_ptr + r1 * stride_x1 + r2 * stride_x2 + cols, mask=mask, other=0.0)  # [BLOCK] in x's dtype
    if HAS_RESIDUAL:
        residual_row = residual_ptr + r1 * stride_r1 + r2 * stride_r2 + cols
        r = tl.load(residual_row, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the sum rounded to the model's dtype, as torch adds
        tl.store(residual_row, x, mask=mask)  # the new residual stream
    h = x.to(tl.float32)  # [BLOCK] the statistics in fp32
    mean_square = tl.sum(h * h, axis=0) / n_cols  # a scalar: masked lanes are 0, so divide by C, not BLOCK
    h = (h * tl.rsqrt(mean_square + eps)).to(x.dtype)  # normalised, rounded to the dtype as the reference does
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # [BLOCK]
    out = w.to(tl.float32) * h.to(tl.float32)  # exact in fp32 for 16-bit inputs: one rounding, at the store
    tl.store(out_ptr + r1 * stride_o1 + r2 * stride_o2 + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., C]
    weight: torch.Tensor,  # [C]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., C], as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) -> out; with `residual`: (RMSNorm(x + residual), x + residual), written into x and residual
    (vLLM's fused_add_rms_norm) when their dtypes allow. The values of RMSNorm.forward_native."""
    C = x.shape[-1]
    assert weight.shape == (C,), f"weight {tuple(weight.shape)} does not fit rows of width {C}"
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # what `weight * h.to(x.dtype)` gives
    if residual is None:
        (x3,) = _as_rows(x)  # [R1, R2, C]
        out3 = torch.empty(x3.shape, dtype=out_dtype, device=x.device)  # a new tensor, as the reference returns
        res3 = x3  # never read: HAS_RESIDUAL is False
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype"
        x3, res3 = _as_rows(x, residual)
        out3 = x3 if out_dtype == x.dtype else torch.empty(x3.shape, dtype=out_dtype, device=x.device)
    if x3.numel() > 0:
        block = triton.next_power_of_2(C)
        _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
            out3, x3, res3, weight,
            out3.stride(0), out3.stride(1), x3.stride(0), x3.stride(1), res3.stride(0), res3.stride(1),
            C, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    out = out3.view(x.shape)
    return out if residual is None else (out, res3.view(x.shape))


def _as_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Tensors [..., C] of one shape as [R1, R2, C] rows with a contiguous last dim, sharing their memory where
    strides can say it: [R, 1, C] when the leading dims merge (contiguous), else [R, H, C] (q [B, T, H, D]
    sliced from qkv). All get the same [R1, R2]: the kernel walks their rows with one grid."""
    ts = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    C = ts[0].shape[-1]
    for shape in ((-1, 1, C), (-1, *ts[0].shape[-2:])) if ts[0].dim() >= 2 else ((-1, 1, C),):
        try:
            return [t.view(shape) for t in ts]
        except RuntimeError:  # some tensor's strides do not merge these dims into one
            continue
    return [t.reshape(-1, 1, C) for t in ts]  # copies: no two strides describe the rows


def _warps(block: int) -> int:
    """Warps for a row of `block` elements: 4 up to 4096 (≤ 32 fp32 values per thread), more for wider rows."""
    return min(16, max(4, block // 1024))


# --------------------------------------------------------------------------------------------------
# 2. Rotary embedding of q and k, in place
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head of q (or k)
    stride_h,  # elements between two heads
    num_heads,  # H (or Hkv): a runtime value
    c,  # [1, HALF_POW2] fp32 cos of each pair's angle
    s,  # [1, HALF_POW2] fp32 sin
    HEADS_POW2: tl.constexpr,  # num_heads rounded up to a power of two (tile shapes must be)
    HEAD_DIM: tl.constexpr,  # D
    HALF_POW2: tl.constexpr,  # D/2 rounded up to a power of two
    IS_NEOX: tl.constexpr,
):
    """Turn pair i of every head by its angle: (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), in place."""
    heads = tl.arange(0, HEADS_POW2)[:, None]  # [HEADS_POW2, 1]
    pair = tl.arange(0, HALF_POW2)[None, :]  # [1, HALF_POW2]
    mask = (heads < num_heads) & (pair < HEAD_DIM // 2)  # [HEADS_POW2, HALF_POW2]
    if IS_NEOX:  # rotate-half: pair i is features (i, i + D/2)
        first = pair
        second = pair + HEAD_DIM // 2
    else:  # GPT-J, interleaved: pair i is features (2i, 2i + 1)
        first = 2 * pair
        second = 2 * pair + 1
    p1 = x_ptr + heads * stride_h + first  # [HEADS_POW2, HALF_POW2] pointers to each pair's first feature
    p2 = x_ptr + heads * stride_h + second
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)  # c, s broadcast over the heads
    tl.store(p2, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [N, H, D], rotated in place (a view into the fused qkv output)
    k_ptr,  # [N, Hkv, D], rotated in place
    cos_ptr,  # [N, D]: each θ_i's value at i and at i + D/2 (only the first half is read)
    sin_ptr,  # [N, D]
    stride_qn,  # elements between two tokens of q (qkv's width when q is a slice of it)
    stride_qh,  # elements between two heads of q
    stride_kn,
    stride_kh,
    stride_cn,  # elements between two tokens' cos
    stride_sn,
    num_heads,  # H
    num_kv_heads,  # Hkv
    HEAD_DIM: tl.constexpr,  # D (even)
    HALF_POW2: tl.constexpr,  # D/2 rounded up to a power of two
    Q_HEADS_POW2: tl.constexpr,
    KV_HEADS_POW2: tl.constexpr,
    IS_NEOX: tl.constexpr,  # True: pairs (i, i + D/2); False: pairs (2i, 2i + 1)
):
    # The grid is (N,): one program turns every head of one token's q and k. The token's D/2 angles are read
    # once and used for all H + Hkv heads: each head is a row of a [HEADS_POW2, HALF_POW2] tile.
    token = tl.program_id(0).to(tl.int64)
    pair = tl.arange(0, HALF_POW2)  # [HALF_POW2]
    in_half = pair < HEAD_DIM // 2
    c = tl.load(cos_ptr + token * stride_cn + pair, mask=in_half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_sn + pair, mask=in_half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qn, stride_qh, num_heads, c, s, Q_HEADS_POW2, HEAD_DIM, HALF_POW2, IS_NEOX)
    _rotate_heads(k_ptr + token * stride_kn, stride_kh, num_kv_heads, c, s, KV_HEADS_POW2, HEAD_DIM, HALF_POW2,
                  IS_NEOX)  # fmt: skip


def rotary(
    q: torch.Tensor,  # [N, H, D] (or [B, T, H, D])
    k: torch.Tensor,  # [N, Hkv, D] (or [B, T, Hkv, D])
    cos: torch.Tensor,  # [N, 1, D] (or [T, 1, D], broadcast over B), as RotaryEmbedding.forward returns
    sin: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated with their tokens' cos, sin, in place where their strides allow: ApplyRotary's values."""
    H, Hkv, D = q.shape[-2], k.shape[-2], q.shape[-1]
    assert D % 2 == 0 and k.shape[-1] == D and q.shape[:-2] == k.shape[:-2], "q [..., H, D], k [..., Hkv, D]"
    q3, k3 = _as_heads(q), _as_heads(k)  # [N, H, D], [N, Hkv, D]
    lead = q.shape[:-2]
    cos2 = cos.expand(*lead, 1, D).reshape(-1, D)  # [N, D]: a view for [N, 1, D]; dense [T, 1, D] is copied B times
    sin2 = sin.expand(*lead, 1, D).reshape(-1, D)
    cos2, sin2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos2, sin2))
    N = q3.shape[0]
    if N > 0:
        _rotary_kernel[(N,)](
            q3, k3, cos2, sin2,
            q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos2.stride(0), sin2.stride(0),
            H, Hkv, HEAD_DIM=D, HALF_POW2=triton.next_power_of_2(D // 2),
            Q_HEADS_POW2=triton.next_power_of_2(H), KV_HEADS_POW2=triton.next_power_of_2(Hkv), IS_NEOX=is_neox,
        )  # fmt: skip
    return q3.view(q.shape), k3.view(k.shape)


def _as_heads(t: torch.Tensor) -> torch.Tensor:
    """t [..., H, D] as [N, H, D] with a contiguous last dim: a view when the leading dims merge, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return t.reshape(-1, *t.shape[-2:])


# --------------------------------------------------------------------------------------------------
# 3. SiLU-and-mul: SwiGLU's gate
# --------------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [R, I]
    x_ptr,  # [R, 2I] = [gate | up], the output of gate_up_proj
    stride_xr,  # elements between two rows of x
    stride_or,
    d,  # I: a runtime value, any size
    BLOCK: tl.constexpr,  # columns per program, a power of two
):
    # The grid is (R, cdiv(I, BLOCK)): program (row, tile) writes columns [tile·BLOCK, (tile + 1)·BLOCK) of a row,
    # reading the gate at those columns and the up value I columns further on.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xr + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(g) = g · sigmoid(g); -inf·0 cannot occur: exp(-g) -> inf gives -0
    tl.store(out_ptr + row * stride_or + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024  # columns per program at most: 128 threads x 8


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) · x[..., I:] [..., I], a new tensor: SiluAndMul.forward_native's values."""
    assert x.shape[-1] % 2 == 0, f"the last dim ({x.shape[-1]}) must be [gate | up], even"
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # [R, 2I], a view for a contiguous x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)  # [..., I]
    out2 = out.view(-1, d)  # [R, I]
    if out2.numel() > 0:
        block = min(_SILU_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(out2.shape[0], triton.cdiv(d, block))](
            out2, x2, x2.stride(0), out2.stride(0), d, BLOCK=block
        )
    return out
