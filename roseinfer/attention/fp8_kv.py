"""An 8-bit KV cache: `kv_cache_dtype="fp8"` stores K and V as float8 e4m3, one byte an element.

A decode step reads every cached K and V vector of every sequence, in every layer; the pool is most of the
memory an engine has, and it bounds how many sequences run at once. In fp32 an element is 4 bytes; in e4m3 it
is 1, so the same memory holds 4x the tokens, and decode attention reads a quarter of the bytes.

    e4m3 (float8_e4m3fn):  s eeee mmm      sign, 4 exponent bits (bias 7), 3 mantissa bits
                           largest 448, smallest normal 2^-6, subnormals down to 2^-9, no infinity

    write   x [N, Hkv, D] float ──► x.to(float8_e4m3fn): rounded to 3 mantissa bits (relative error <= 1/16),
                                    saturated to ±448 (torch's cast saturates; NaN stays NaN)
    read    pool [blocks, bs, Hkv, D] fp8 ──► fp32 as it is loaded (the C++ kernel converts 16 bytes to 16 floats
                                    in registers, csrc/paged_attention.cpp's `load`; the sdpa path converts
                                    the blocks it gathers), every sum in fp32 as before

vLLM's flag, with its default scales: a checkpoint may carry per-layer `k_scale`/`v_scale` (stored value =
x / scale); without them vLLM uses 1.0, which is what roseinfer does: the stored value is x itself. A K or V
element beyond ±448 is clipped, so this suits models whose K/V stay in range (the bundled ones do:
the chapter measures the perplexity it costs).

Only the pool changes. The query, the output, a prompt's first chunk (attended with its own fresh K/V, as
vLLM does) and every other tensor keep the model's dtype; block copies, swap and prefix caching move
blocks as they are, whatever their dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}  # vLLM's names for what we store


def pick_kv_cache_dtype(name) -> torch.dtype | None:
    """`kv_cache_dtype` -> the pool's torch dtype; None for "auto" (the model's dtype)."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r} ({type(name).__name__})")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_fp8(pool: torch.Tensor) -> bool:
    return pool.dtype == FP8_DTYPE


def write_slots(pool: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """pool [num_blocks, block_size, Hkv, D] <- x [N, Hkv, D] at the N slots, converted to the pool's dtype.
    torch has no `index_copy_` for float8 on a CPU, so an fp8 pool is written through its bytes (a uint8 view)."""
    Hkv, D = x.shape[1:]
    if is_fp8(pool):
        pool.view(torch.uint8).view(-1, Hkv, D).index_copy_(0, slot_mapping, x.to(FP8_DTYPE).view(torch.uint8))
    else:
        pool.view(-1, Hkv, D).index_copy_(0, slot_mapping, x)


def dequantize(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K or V in the pool's dtype -> `dtype` (the query's), for an op that reads only floats
    (SDPA); the same tensor when there is nothing to convert."""
    return kv if kv.dtype == dtype else kv.to(dtype)
