"""An fp8 KV cache in the Triton kernels (vLLM's `kv_cache_dtype="fp8"`): what changes, and what does not.

With `kv_cache_dtype="fp8"` the K and V pools ([num_blocks, block_size, Hkv, D]) are `torch.float8_e4m3fn`:
one byte per element instead of two (fp16/bf16), so a pool holds twice the tokens and a decode step, which is
bound by the bytes of K/V it reads, reads half of them. e4m3 keeps 4 exponent bits and 3 mantissa bits: values
up to ±448, about two significant digits. The query and the output stay in the model's dtype.

    write (_write_kv_kernel)        x -> fp32 -> clamp to ±448 -> fp8   `_to_cache` below
    read  (decode, split, prefill)  fp8 -> fp32, exact, then the math as before (every kernel already loads K and V
                                    with `.to(tl.float32)`: nothing changes there)
    copy  (_copy_blocks_kernel)     bytes: the copy moves bits, never converts (triton_copy.py)

Scales: vLLM multiplies by k_scale / v_scale around the cast; a checkpoint without them gets 1.0, and so does
roseinfer (no scales are loaded): the stored value is x itself, rounded to e4m3 (to nearest, ties to even) and
saturated at ±448, exactly `x.clamp(-448, 448).to(torch.float8_e4m3fn)`. e4m3fn has no infinity: torch's cast
and sm_90's `cvt.rn.satfinite` saturate by themselves, but not every conversion does (the interpreter's turns
1000 into NaN, which would poison every softmax that reads it), so the write clamps and never relies on it.

On a GPU: Triton's fp8e4nv type needs sm_89 or newer (Ada, Hopper), so tools/triton_aot.py compiles the fp8 pool
variants for sm_90 only, where the write is one `cvt.rn.satfinite.e4m3x2.f32` per two values and the read one
`cvt.rn.f16x2.e4m3x2` (then to fp32). On an A100 (sm_80) Triton refuses fp8e4nv. Never run on a GPU.

In Triton's CPU interpreter (the tests): loading fp8 and converting it to fp32 is exact, but the interpreter's own
fp32 -> fp8 cast (`_convert_float` in Triton 3.7.1; an upstream fix, triton-lang/triton#11897, is open) rounds ties
away from zero and drops the carry when rounding overflows the mantissa (127.97 becomes 64).
tests/test_22_triton_fp8_kv.py swaps in torch's rounding, the one cvt.rn.satfinite does.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value (a constexpr: kernels read it)


@triton.jit
def _to_cache(x, cache_ptr):
    """A tile of new K (or V) -> the pool's element type. An fp8 pool saturates at ±448 first (NaN stays NaN, as
    torch's clamp keeps it); a float pool is a plain cast, as before."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return x.to(cache_ptr.dtype.element_ty)
