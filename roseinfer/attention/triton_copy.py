"""Copying KV blocks in Triton (vLLM's `copy_blocks`): the copy of copy-on-write, every layer in ONE launch.

A step's copies come as `block_mapping` rows (src, dst): block dst of every layer's K and V pool gets a
copy of block src (see `copy_blocks_reference` for why, and why no dst may be a src). In one pool,
[num_blocks, block_size, Hkv, D] and contiguous, block `b` is the `block_size * Hkv * D` elements starting
at element `b * block_size * Hkv * D`: a block copy is a copy of one contiguous run, whatever Hkv, D and
block_size are, so a program moves a 1-D tile of TILE elements of it (a power of two, masked at the end).

One launch for all layers. A copy is tiny (a GPT-2 medium fp16 block is 16 * 16 * 64 * 2 = 32 KB), and a
model has 2 pools per layer (48 in GPT-2 medium). One launch per pool would pay a launch's host time
(microseconds) for every 32 KB moved, and leave most of the GPU idle. So, as vLLM's CUDA kernel does,
the kernel takes the pools' *addresses* as data: a small int64 table, row l = (K pool, V pool) of
layer l, filled from `tensor.data_ptr()`. A program loads its layer's address and casts it to a typed
pointer, `.to(tl.pointer_type(DTYPE))`, like `(scalar_t *) ptrs[layer]` in C. The grid gets a layer axis:

    grid = (P pairs, L layers, cdiv(block_size * Hkv * D, TILE) tiles)

What this costs, and why it is safe:
- The compiler learns nothing from an address it loads, not even its alignment, so it would move one
  element per instruction. `tl.multiple_of(ptr, 16)` promises 16-byte alignment (the wrapper checks it;
  torch's allocations are aligned far more) and buys 16-byte vector loads and stores
  (`ld.global.v4.b32` in `scripts/triton_aot.py`'s table, instead of `ld.global.b16` for fp16).
- The pools are not kernel arguments, so nothing checks their device: the wrapper does. In Triton's CPU
  interpreter the addresses are real host addresses and the interpreter reads them directly (CPU
  tensors are not copied for it), so the same kernel runs in the tests; a CUDA pool is refused there.
- The table is rebuilt only when the pools change (an engine's pools never do): steady state, a launch
  costs one small copy of `block_mapping` to the GPU, the only transfer that building the pairs needs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from roseinfer.attention.reference import check_copy_blocks_args

_MAX_TILE = 1024  # elements per program at most: 128 threads x 8 (16 bytes of fp16); tests shrink it
_TL_DTYPES = {  # the pointer type a pool's elements are moved as: a copy never converts, so only the size matters
    torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
    torch.float8_e4m3fn: tl.uint8,  # kv_cache_dtype="fp8": moved as bytes, which needs no fp8 type (any GPU)
}  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # [L, 2] int64: addresses (data_ptr) of layer l's K pool at [l, 0], its V pool at [l, 1]
    block_mapping_ptr,  # [P, 2] int64: (src, dst) physical block ids
    numel_per_block,  # block_size * Hkv * D: one block of one pool is this many contiguous elements
    DTYPE: tl.constexpr,  # the pools' element type (tl.float16, ...): an address loaded from memory has none
    TILE: tl.constexpr,  # elements per program, a power of two
):
    # The grid is (P, L, tiles): program (pair, layer, tile) copies elements [tile * TILE, (tile + 1) * TILE)
    # of block src into block dst, in this layer's K pool and in its V pool.
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    tile = tl.program_id(2)
    src = tl.load(block_mapping_ptr + 2 * pair)  # int64 scalars, so `src * numel_per_block` cannot overflow
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)

    # int64 -> typed pointer: from here on, `k_pool + offsets` is pointer arithmetic in elements, as for an argument.
    k_pool = tl.load(cache_ptrs_ptr + 2 * layer).to(tl.pointer_type(DTYPE))
    v_pool = tl.load(cache_ptrs_ptr + 2 * layer + 1).to(tl.pointer_type(DTYPE))
    k_pool = tl.multiple_of(k_pool, 16)  # "16-byte aligned": lets Triton move 16 bytes per load and store
    v_pool = tl.multiple_of(v_pool, 16)

    offs = tile * TILE + tl.arange(0, TILE)  # [TILE] element offsets inside one block
    mask = offs < numel_per_block  # [TILE] the last tile may hang over the end of the block
    src_offs = src * numel_per_block + offs  # [TILE] int64 offsets into the pool
    dst_offs = dst * numel_per_block + offs
    k = tl.load(k_pool + src_offs, mask=mask)  # [TILE] in the pool's dtype: a copy moves bits, no cast
    v = tl.load(v_pool + src_offs, mask=mask)
    tl.store(k_pool + dst_offs, k, mask=mask)
    tl.store(v_pool + dst_offs, v, mask=mask)


def copy_blocks_triton(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per layer, each [num_blocks, block_size, Hkv, D]
    block_mapping: torch.Tensor,  # [P, 2] int: copy physical block src -> dst, in every layer's K and V
) -> None:
    """Copy block src to block dst in every layer's K and V pool, all pairs and layers in one launch."""
    check_copy_blocks_args(kv_caches, block_mapping)
    k0 = kv_caches[0][0]
    _check_pools(kv_caches)
    P = block_mapping.shape[0]
    if P == 0:  # nothing to copy (most steps): no launch, no transfer
        return
    numel_per_block = math.prod(k0.shape[1:])  # block_size * Hkv * D
    mapping = block_mapping.to(device=k0.device, dtype=torch.int64).contiguous()  # [P, 2], on the pools' device
    grid = (P, len(kv_caches), triton.cdiv(numel_per_block, _tile_for(numel_per_block)))
    _copy_blocks_kernel[grid](
        _pointer_table(kv_caches), mapping, numel_per_block,
        DTYPE=_TL_DTYPES[k0.dtype], TILE=_tile_for(numel_per_block),
    )  # fmt: skip


def _tile_for(numel_per_block: int) -> int:
    """Elements per program: _MAX_TILE, or less for a small block (a power of two covering it)."""
    return min(_MAX_TILE, triton.next_power_of_2(numel_per_block))


_table: tuple[tuple[torch.device, tuple[int, ...]], torch.Tensor] | None = None  # the last pointer table built


def _pointer_table(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # [L, 2] int64
    """The pools' addresses on their device, rebuilt (one small host-to-device copy) only when they change."""
    global _table
    device = kv_caches[0][0].device
    addresses = tuple(t.data_ptr() for kv in kv_caches for t in kv)  # K0, V0, K1, V1, ...
    if _table is None or _table[0] != (device, addresses):
        table = torch.tensor(addresses, dtype=torch.int64).reshape(len(kv_caches), 2)  # [L, 2]
        _table = ((device, addresses), table.to(device))
    return _table[1]


def _check_pools(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """What the kernel needs beyond `check_copy_blocks_args`: it reaches the pools by raw address."""
    k0 = kv_caches[0][0]
    if k0.dtype not in _TL_DTYPES:
        raise ValueError(f"copy_blocks_triton: pools must be float32, float16, bfloat16 or fp8, got {k0.dtype}")
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not t.is_contiguous():  # a block is one contiguous run only in a contiguous pool
                raise ValueError(f"copy_blocks_triton: layer {layer}'s {name} is not contiguous")
            if t.data_ptr() % 16:  # what `tl.multiple_of(..., 16)` promises the compiler
                raise ValueError(f"copy_blocks_triton: layer {layer}'s {name} does not start on a 16-byte boundary")
    interpreted = isinstance(_copy_blocks_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 when it was defined
    if interpreted != (k0.device.type == "cpu"):
        where = "Triton's CPU interpreter reads host memory only" if interpreted else "compiled Triton needs CUDA"
        raise ValueError(f"copy_blocks_triton: pools on {k0.device}, but {where}")
