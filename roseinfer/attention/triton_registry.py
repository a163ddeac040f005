"""Every Triton kernel of roseinfer, for compiling it without a GPU: the arguments of a real launch at a model's
shape, its grid, and the bytes one launch must read. tools/triton_aot.py compiles each entry of KERNELS for sm_80 and
sm_90 and prints the decode roofline from `bytes_read`.

A new kernel in a file of MODULES (triton_kernels.py, triton_prefill.py, triton_copy.py, the model's fused ops in
roseinfer/model_executor/triton_ops.py, the W8A8 kernels in model_executor/quantization/triton_int8.py) gets an entry
in KERNELS; tests/test_08_triton_aot.py fails until it has one.
This table is the one module of attention/ that imports from model_executor/ (a layer above it): it lists every
kernel for the compiler, and the engine never imports it. SHAPES are multi-head models; GQA_SHAPES grouped-query ones
(fewer K/V heads than query heads). FP8_SHAPES: the kernels that touch the KV pools (FP8_KERNELS) with float8_e4m3fn
pools (kv_cache_dtype="fp8"), compiled for FP8_TARGETS only: Triton's fp8e4nv needs sm_89+, it refuses sm_80.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import triton
import triton.language as tl

from roseinfer.attention import triton_copy, triton_kernels, triton_prefill
from roseinfer.model_executor import triton_ops
from roseinfer.model_executor.quantization import triton_int8

MODULES = [triton_kernels, triton_prefill, triton_copy, triton_ops, triton_int8]  # every file that launches kernels

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8e4nv": 1}
# a dtype as a kernel's constexpr; fp8 pools are copied as bytes, as copy_blocks_triton does
TL_DTYPES = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32, "fp8e4nv": tl.uint8}


@dataclass(frozen=True)
class Shape:
    """A model's attention shape, and the decode launch the byte counts assume."""

    name: str
    n_head: int  # H
    head_dim: int  # D
    n_ctx: int  # the model's context: every sequence of the launch is this long
    n_layer: int  # layers: copy_blocks copies in all of them in one launch
    block_size: int = 16  # tokens per KV block (the engine's default)
    dtype: str = "fp16"  # the GPU default
    batch: int = 64  # sequences in the decode step
    splits: int = 4  # S for the split-K kernels
    n_kv_head: int = 0  # Hkv, the K/V heads (grouped-query attention); 0 = n_head (multi-head attention)
    n_inner: int = 0  # I, the MLP's width (SwiGLU's gate and up are I each); 0 = 4 * hidden, GPT-2's
    kv_dtype: str = ""  # the KV pools' dtype; "" = dtype; "fp8e4nv" = kv_cache_dtype="fp8" (float8_e4m3fn)

    @property
    def kv(self) -> str:  # the pools' dtype, as a pointer's type name
        return self.kv_dtype or self.dtype

    @property
    def max_blocks(self) -> int:  # width of the block table
        return math.ceil(self.n_ctx / self.block_size)

    @property
    def kv_heads(self) -> int:  # Hkv: the heads of the KV pool
        return self.n_kv_head or self.n_head

    @property
    def group(self) -> int:  # G = H // Hkv: query heads per K/V head
        return self.n_head // self.kv_heads

    @property
    def hidden(self) -> int:  # C, the residual stream's width (H * D in every model listed here)
        return self.n_head * self.head_dim

    @property
    def inner(self) -> int:  # I
        return self.n_inner or 4 * self.hidden

    @property
    def qkv_width(self) -> int:  # elements per token of the fused QKV projection: q, k and v are views into it
        return (self.n_head + 2 * self.kv_heads) * self.head_dim


SHAPES = [
    Shape("tiny-shakespeare", n_head=4, head_dim=64, n_ctx=512, n_layer=4),  # the bundled model
    Shape("gpt2", n_head=12, head_dim=64, n_ctx=1024, n_layer=12),  # GPT-2 small
    Shape("gpt2-medium", n_head=16, head_dim=64, n_ctx=1024, n_layer=24),
]
GQA_SHAPES = [  # grouped-query attention: G = n_head // n_kv_head query heads read each K/V head; n_inner: SwiGLU's I
    # G = 3, Hkv not a power of 2
    Shape("smollm2-135m", n_head=9, n_kv_head=3, head_dim=64, n_ctx=8192, n_layer=30, n_inner=1536),
    Shape("qwen2.5-0.5b", n_head=14, n_kv_head=2, head_dim=64, n_ctx=32768, n_layer=24, n_inner=4864),  # G = 7
]
# every kernel that touches the KV pools
FP8_KERNELS = ["_write_kv_kernel", "_paged_attention_kernel", "_paged_attention_split_kernel",
               "_prefill_attention_kernel", "_copy_blocks_kernel"]  # fmt: skip
FP8_TARGETS = ["sm_90"]  # fp8e4nv conversions need sm_89+ (Ada, Hopper): Triton refuses them for sm_80
FP8_SHAPES = [dataclasses.replace(s, name=f"{s.name}/fp8", kv_dtype="fp8e4nv") for s in (SHAPES[1], GQA_SHAPES[0])]


# One launch argument: (Triton type, value). Pointers are 16-byte aligned (torch allocations are);
# an int that is a multiple of 16 gets Triton's divisibility hint, as `kernel[grid](...)` gives it.
def ptr(dtype: str) -> tuple[str, None]:
    return ("*" + dtype, None)


def i32(value: int) -> tuple[str, int]:
    return ("i32", value)


def int_arg(value: int) -> tuple[str, int]:
    """A runtime int as a launch passes it: Triton specializes an int equal to 1 into a constant (G = 1, MHA)."""
    return const(1) if value == 1 else i32(value)


def f32() -> tuple[str, None]:
    return ("fp32", None)


def const(value: int | str | tl.dtype) -> tuple[str, int | str | tl.dtype]:
    return ("constexpr", value)


@dataclass(frozen=True)
class Kernel:
    args: Callable[[Shape], dict[str, tuple[str, int | None]]]  # every parameter, in order
    grid: Callable[[Shape], tuple[int, ...]]
    bytes_read: Callable[[Shape], int]  # what one launch must read from memory, at least


def _kv_bytes(s: Shape) -> int:  # K and V of every sequence's whole context, read once (Hkv heads)
    return 2 * s.batch * s.n_ctx * s.kv_heads * s.head_dim * DTYPE_BYTES[s.kv]


def _decode_args(s: Shape) -> dict[str, tuple[str, int | None]]:  # q, cache, table arguments
    return dict(
        q_ptr=ptr(s.dtype), k_cache_ptr=ptr(s.kv), v_cache_ptr=ptr(s.kv),
        block_tables_ptr=ptr("i32"), context_lens_ptr=ptr("i32"), scale=f32(), num_queries_per_kv=int_arg(s.group),
        stride_qb=i32(s.qkv_width), stride_qh=i32(s.head_dim),  # q is a view into the fused c_attn output
    )  # fmt: skip


def _cache_strides(s: Shape) -> dict[str, tuple[str, int]]:
    Hkv, D, BS = s.kv_heads, s.head_dim, s.block_size
    return dict(stride_cache_block=i32(BS * Hkv * D), stride_cache_slot=i32(Hkv * D), stride_cache_head=i32(D))


def _q_and_tables_bytes(s: Shape) -> int:
    return s.batch * s.n_head * s.head_dim * DTYPE_BYTES[s.dtype] + s.batch * (s.max_blocks + 1) * 4


PREFILL_PROMPTS, PREFILL_BLOCK_M = 4, 64  # a prefill launch: 4 whole prompts of the model's context


def _prefill_bytes(s: Shape) -> int:  # q and out of every prompt token, and K/V of every context read once
    tokens = PREFILL_PROMPTS * s.n_ctx
    q_and_out = 2 * s.n_head * DTYPE_BYTES[s.dtype]  # per token and head dim: q and out, H heads
    kv = 2 * s.kv_heads * DTYPE_BYTES[s.kv]  # K and V: Hkv heads
    return tokens * (q_and_out + kv) * s.head_dim + PREFILL_PROMPTS * (s.max_blocks + 2) * 4


COPY_PAIRS = 64  # a copy_blocks launch: 64 (src, dst) pairs, e.g. 64 forked sequences writing into shared blocks


def _block_numel(s: Shape) -> int:  # elements of one block of one pool
    return s.block_size * s.kv_heads * s.head_dim


def _int8_quant_args(s: Shape) -> dict[str, tuple[str, int | None]]:
    return dict(
        x_ptr=ptr(s.dtype), x_q_ptr=ptr("i8"), scale_ptr=ptr("fp32"),
        stride_xn=i32(s.hidden), stride_qn=i32(s.hidden), n_cols=i32(s.hidden),
        STATIC=const(False), BLOCK=const(min(triton_int8._QUANT_BLOCK, triton.next_power_of_2(s.hidden))),
    )  # fmt: skip


def _mm_tiles(s: Shape) -> tuple[int, int, int, int]:  # as scaled_mm_triton picks them for s.batch rows
    return triton_int8._tiles(s.batch)


def _scaled_mm_args(s: Shape) -> dict[str, tuple[str, int | None]]:
    block_m, block_n, block_k, _ = _mm_tiles(s)
    return dict(
        out_ptr=ptr(s.dtype), x_q_ptr=ptr("i8"), w_ptr=ptr("i8"), x_scale_ptr=ptr("fp32"), w_scale_ptr=ptr("fp32"),
        bias_ptr=ptr("fp32"), M=i32(s.batch), N=i32(s.qkv_width), K=i32(s.hidden),
        stride_xm=i32(s.hidden), stride_wn=i32(s.hidden), stride_wk=int_arg(1), stride_om=i32(s.qkv_width),
        PER_TOKEN=const(True), HAS_BIAS=const(False), BLOCK_M=const(block_m), BLOCK_N=const(block_n),
        BLOCK_K=const(block_k),
    )  # fmt: skip


KERNELS: dict[str, Kernel] = {
    # reshape_and_cache: one decode step writes one new token per sequence
    "_write_kv_kernel": Kernel(
        args=lambda s: dict(
            key_ptr=ptr(s.dtype),
            value_ptr=ptr(s.dtype),
            k_cache_ptr=ptr(s.kv),
            v_cache_ptr=ptr(s.kv),
            slot_mapping_ptr=ptr("i64"),
            stride_kn=i32(s.qkv_width),  # K and V are views into c_attn's fused output
            stride_kh=i32(s.head_dim),
            stride_vn=i32(s.qkv_width),
            stride_vh=i32(s.head_dim),
            **_cache_strides(s),
            num_heads=int_arg(s.kv_heads),  # the pool's heads
            BLOCK_SIZE=const(s.block_size),
            HEAD_DIM=const(s.head_dim),
            HEADS_POW2=const(triton.next_power_of_2(s.kv_heads)),
        ),
        grid=lambda s: (s.batch,),
        bytes_read=lambda s: 2 * s.batch * s.kv_heads * s.head_dim * DTYPE_BYTES[s.dtype] + s.batch * 8,
    ),
    # decode attention, one program per (sequence, head)
    "_paged_attention_kernel": Kernel(
        args=lambda s: dict(
            out_ptr=ptr(s.dtype),
            **_decode_args(s),
            stride_ob=i32(s.n_head * s.head_dim),
            stride_oh=i32(s.head_dim),
            stride_table=i32(s.max_blocks),
            **_cache_strides(s),
            BLOCK_SIZE=const(s.block_size),
            HEAD_DIM=const(s.head_dim),
        ),
        grid=lambda s: (s.batch, s.n_head),
        bytes_read=lambda s: _kv_bytes(s) + _q_and_tables_bytes(s),
    ),
    # split-K decode attention: S programs per (sequence, head), partial results to fp32 scratch
    "_paged_attention_split_kernel": Kernel(
        args=lambda s: dict(
            m_ptr=ptr("fp32"),
            l_ptr=ptr("fp32"),
            acc_ptr=ptr("fp32"),
            **_decode_args(s),
            stride_table=i32(s.max_blocks),
            **_cache_strides(s),
            BLOCK_SIZE=const(s.block_size),
            HEAD_DIM=const(s.head_dim),
        ),
        grid=lambda s: (s.batch, s.n_head, s.splits),
        bytes_read=lambda s: _kv_bytes(s) + _q_and_tables_bytes(s),
    ),
    # merges the S partial softmaxes of each (sequence, head)
    "_reduce_splits_kernel": Kernel(
        args=lambda s: dict(
            out_ptr=ptr(s.dtype),
            m_ptr=ptr("fp32"),
            l_ptr=ptr("fp32"),
            acc_ptr=ptr("fp32"),
            stride_ob=i32(s.n_head * s.head_dim),
            stride_oh=i32(s.head_dim),
            num_splits=i32(s.splits),
            SPLITS_POW2=const(triton.next_power_of_2(s.splits)),
            HEAD_DIM=const(s.head_dim),
        ),
        grid=lambda s: (s.batch, s.n_head),
        bytes_read=lambda s: s.batch * s.n_head * s.splits * (s.head_dim + 2) * 4,
    ),
    # prefill attention (stage 09): a tile of BLOCK_M queries of one prompt against its whole paged context
    "_prefill_attention_kernel": Kernel(
        args=lambda s: dict(
            out_ptr=ptr(s.dtype),
            q_ptr=ptr(s.dtype),
            k_cache_ptr=ptr(s.kv),
            v_cache_ptr=ptr(s.kv),
            block_tables_ptr=ptr("i32"),
            query_start_loc_ptr=ptr("i32"),
            seq_lens_ptr=ptr("i32"),
            scale=f32(),
            num_queries_per_kv=int_arg(s.group),
            stride_qn=i32(s.qkv_width),  # q is a view into the fused c_attn output
            stride_qh=i32(s.head_dim),
            stride_on=i32(s.n_head * s.head_dim),
            stride_oh=i32(s.head_dim),
            stride_table=i32(s.max_blocks),
            **_cache_strides(s),
            BLOCK_SIZE=const(s.block_size),
            HEAD_DIM=const(s.head_dim),
            BLOCK_M=const(PREFILL_BLOCK_M),
            BLOCK_N=const(max(16, min(s.block_size, 64))),  # as prefill_attention_triton picks them
            DOT_PRECISION=const("tf32"),  # fp16 runs on the tensor cores
        ),
        grid=lambda s: (PREFILL_PROMPTS, s.n_head, triton.cdiv(s.n_ctx, PREFILL_BLOCK_M)),
        bytes_read=_prefill_bytes,
    ),
    # copy-on-write: COPY_PAIRS block copies in every layer's K and V pool, one launch for all layers
    "_copy_blocks_kernel": Kernel(
        args=lambda s: dict(
            cache_ptrs_ptr=ptr("i64"),
            block_mapping_ptr=ptr("i64"),
            numel_per_block=i32(_block_numel(s)),
            DTYPE=const(TL_DTYPES[s.kv]),
            TILE=const(triton_copy._tile_for(_block_numel(s))),  # as copy_blocks_triton picks it
        ),
        grid=lambda s: (COPY_PAIRS, s.n_layer, triton.cdiv(_block_numel(s), triton_copy._tile_for(_block_numel(s)))),
        bytes_read=lambda s: (
            2 * s.n_layer * COPY_PAIRS * _block_numel(s) * DTYPE_BYTES[s.kv] + COPY_PAIRS * 16 + s.n_layer * 16
        ),  # the src blocks, the pairs, the pointer table
    ),
    # the fused ops of a Llama layer (model_executor/triton_ops.py), each at one decode step of s.batch tokens:
    # RMSNorm with the residual add, in place (x -> out): a row of C per token
    "_rms_norm_kernel": Kernel(
        args=lambda s: dict(
            out_ptr=ptr(s.dtype),
            x_ptr=ptr(s.dtype),
            residual_ptr=ptr(s.dtype),
            weight_ptr=ptr(s.dtype),
            **{f"stride_{t}{i}": i32(s.hidden) for t in "oxr" for i in (1, 2)},  # [B, 1, C] rows, contiguous
            n_cols=i32(s.hidden),
            eps=f32(),
            HAS_RESIDUAL=const(True),
            BLOCK=const(triton.next_power_of_2(s.hidden)),
        ),
        grid=lambda s: (s.batch, 1),
        bytes_read=lambda s: (2 * s.batch + 1) * s.hidden * DTYPE_BYTES[s.dtype],  # x, residual, weight
    ),
    # q and k rotated in place, as views into the fused qkv output; neox layout
    "_rotary_kernel": Kernel(
        args=lambda s: dict(
            q_ptr=ptr(s.dtype),
            k_ptr=ptr(s.dtype),
            cos_ptr=ptr(s.dtype),
            sin_ptr=ptr(s.dtype),
            stride_qn=i32(s.qkv_width),
            stride_qh=i32(s.head_dim),
            stride_kn=i32(s.qkv_width),
            stride_kh=i32(s.head_dim),
            stride_cn=i32(s.head_dim),  # cos, sin [N, 1, D] as RotaryEmbedding.forward returns them
            stride_sn=i32(s.head_dim),
            num_heads=int_arg(s.n_head),
            num_kv_heads=int_arg(s.kv_heads),
            HEAD_DIM=const(s.head_dim),
            HALF_POW2=const(triton.next_power_of_2(s.head_dim // 2)),
            Q_HEADS_POW2=const(triton.next_power_of_2(s.n_head)),
            KV_HEADS_POW2=const(triton.next_power_of_2(s.kv_heads)),
            IS_NEOX=const(True),
        ),
        grid=lambda s: (s.batch,),
        bytes_read=lambda s: s.batch * (s.n_head + s.kv_heads + 1) * s.head_dim * DTYPE_BYTES[s.dtype],  # + D/2 each
    ),
    # SwiGLU's gate: [B, 2I] -> [B, I]
    "_silu_and_mul_kernel": Kernel(
        args=lambda s: dict(
            out_ptr=ptr(s.dtype),
            x_ptr=ptr(s.dtype),
            stride_xr=i32(2 * s.inner),
            stride_or=i32(s.inner),
            d=i32(s.inner),
            BLOCK=const(_silu_block(s)),
        ),
        grid=lambda s: (s.batch, triton.cdiv(s.inner, _silu_block(s))),
        bytes_read=lambda s: s.batch * 2 * s.inner * DTYPE_BYTES[s.dtype],
    ),
    # W8A8 (model_executor/quantization/triton_int8.py) at the qkv projection of a decode step of s.batch tokens:
    # x [B, C] quantized per token, then x_q · W_qᵀ (W_q [qkv_width, C] int8) with the two scales in the epilogue
    "_int8_quant_kernel": Kernel(
        args=_int8_quant_args,
        grid=lambda s: (s.batch,),
        bytes_read=lambda s: s.batch * s.hidden * DTYPE_BYTES[s.dtype],  # x (its second pass hits the cache)
    ),
    "_scaled_mm_kernel": Kernel(
        args=_scaled_mm_args,
        grid=lambda s: (triton.cdiv(s.batch, _mm_tiles(s)[0]), triton.cdiv(s.qkv_width, _mm_tiles(s)[1])),
        bytes_read=lambda s: (s.batch + s.qkv_width) * (s.hidden + 4),  # x_q and W_q (int8), and their scales
    ),
}


def _silu_block(s: Shape) -> int:  # as silu_and_mul picks it
    return min(triton_ops._SILU_BLOCK, triton.next_power_of_2(s.inner))


def launched_kernels() -> set[str]:
    """The @triton.jit functions that roseinfer's kernel files launch (`name[grid](...)`)."""
    source = "".join(Path(m.__file__).read_text() for m in MODULES)
    return set(re.findall(r"^\s+(_\w+)\[(?:\(|grid\])", source, flags=re.MULTILINE))
