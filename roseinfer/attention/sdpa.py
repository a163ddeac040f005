"""The fast CPU path: PyTorch's fused `scaled_dot_product_attention` on the paged cache.

The reference (`reference.py`) is written to be obviously right; on a CPU it is slow because it
copies: every layer of every step gathers each sequence token by token, upcasts to fp32 and masks
with full-size `torch.where` passes, and its KV write splits slots into (block, offset) pairs for a
two-index scatter. This path does the same math with as few copies as possible:

  KV write                                   one index_copy_ into the pool's flat [slots, Hkv, D] view
                                             (on a CPU, the C++ op reshape_and_cache: one pass, csrc/cache.cpp)

  decodes (one query each), a few runs of similar length at once:
      k_cache.index_select(0, block ids)     one copy per *block* (16 slots of [Hkv, D] in a row),
      -> [B, max_blocks * block_size, Hkv, D] in logical order, viewed as [B, Hkv, L, D] (no copy)
      SDPA with a boolean mask [B, 1, 1, L]  positions >= seq_len switched off inside the kernel
  decodes that all start with the same cached blocks (prefix caching): cascade attention,
      the shared prefix read once for all rows, each run's own tokens after it, merged by log-sum-exp
  prefill chunks, one request at a time:
      a first chunk (no context yet)         attends to its own fresh K/V: SDPA is_causal, no gather
      a later chunk                          gathers its blocks once, SDPA with an offset causal mask

Grouped-query attention (Hkv < H K/V heads, G = H // Hkv query heads per K/V head, query head h reads
K/V head h // G): SDPA wants as many K/V heads as query heads, and repeating K/V G times would copy
them. Instead, the G query heads of a group become G query *rows* of one K/V head:

    q [B, H, D] -> [B, Hkv, G, D]          a view: heads h = kv * G + g, so G "queries" per K/V head
    K, V [B, Hkv, L, D]                    as gathered, no copy
    out [B, Hkv, G, D] -> [B, H, D]        a view back

A decode's mask [B, 1, 1, L] broadcasts over the G rows unchanged, since they sit at one position. A later
prefill chunk does the same with T queries: [Hkv, G * T, D] rows, its causal mask repeated G times. A first
chunk keeps SDPA's is_causal (which skips the masked half of the work), so there K/V are repeated instead:
T tokens' K/V, small next to that chunk's T² attention. (SDPA's own enable_gqa=True does that repeat too,
on a CPU through its slow unfused path, so it is not used.) With G = 1 every one of these is today's MHA
call, the same views and the same kernel.

Masked slots are never zeroed, so they must hold finite numbers (0 * NaN is NaN even at weight 0).
They do: the pool starts as zeros and only ever receives K/V vectors. The reference tolerates NaN
garbage; this path relies on that invariant instead of paying for it every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from roseinfer.attention.fp8_kv import dequantize, write_slots
from roseinfer.attention.reference import kv_groups
from roseinfer.custom_ops import available as cpu_ops_available

if TYPE_CHECKING:
    from roseinfer.attention import AttentionMetadata


class GatherBuffer:
    """Reusable scratch for the gathered K and V blocks, shared by every layer and every step.

    A decode step gathers megabytes of K/V per layer. Asking for a fresh tensor each time makes the
    allocator hand back fresh pages, and the kernel zero-fills each page on first touch: on a CPU
    that costs as much as the copy itself. So the model runner owns one buffer pair, grown when a
    step needs more, and `index_select(..., out=)` writes into it.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [capacity, block_size, Hkv, D]
        self.v: torch.Tensor | None = None

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `num_blocks` blocks, [num_blocks, block_size, Hkv, D] each, like `like`'s blocks."""
        if self.k is None or self.k.shape[0] < num_blocks or self.k.shape[1:] != like.shape[1:]:
            capacity = max(num_blocks, 2 * self.k.shape[0] if self.k is not None else 0)
            self.k = like.new_empty((capacity, *like.shape[1:]))
            self.v = like.new_empty((capacity, *like.shape[1:]))
        return self.k[:num_blocks], self.v[:num_blocks]


def write_kv_flat(
    key: torch.Tensor,  # [N, Hkv, D] K of the N new tokens
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64, every slot real (this engine never pads)
) -> None:
    """Scatter new K/V into the pool: one `index_copy_` per tensor into its flat view
    [num_blocks * block_size, Hkv, D], where row `slot` is exactly that slot (an fp8 pool: fp8_kv.py).
    On a CPU, a pool in K's dtype is written by `torch.ops.roseinfer.reshape_and_cache` (csrc/cache.cpp):
    the same rows, copied in one pass from the strided views without making them contiguous first."""
    if key.device.type == "cpu" and k_cache.dtype == key.dtype and cpu_ops_available():
        torch.ops.roseinfer.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    write_slots(k_cache, slot_mapping, key)
    write_slots(v_cache, slot_mapping, value)


@dataclass
class DecodeRun:
    """Decode rows a .. b-1, attended in one call, each padded to `width` blocks."""

    a: int
    b: int
    blocks: torch.Tensor  # [(b - a) * width] int64: every row's first `width` table entries, flattened
    real: torch.Tensor  # [b - a, 1, 1, width * block_size] bool: True where a row has a token


@dataclass
class PrefillChunk:
    """One request's prompt chunk: query rows s .. e-1, at the end of its seq_len tokens."""

    s: int
    e: int
    seq_len: int
    blocks: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None for a first chunk (no gather)
    causal: torch.Tensor | None  # [e - s, seq_len] bool: query at position p sees keys 0 .. p


@dataclass
class SdpaPlan:
    """What every layer of one step needs, worked out once per step by `plan_sdpa` (the model runner
    calls it through the backend's `prepare`), instead of once per layer."""

    decode_runs: list[DecodeRun]
    chunks: list[PrefillChunk]
    prefix_blocks: torch.Tensor | None = None  # blocks every decode row starts with (cascade)


CASCADE_MIN_ROWS, CASCADE_MIN_BLOCKS = 4, 4  # a shared prefix this big is worth attending to separately


def common_prefix_blocks(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> int:
    """How many leading blocks all rows share (the same physical ids, so the same K/V: prefix caching).
    Each row's last block is its own, so at most (shortest seq_len - 1) // block_size."""
    limit = (min(seq_lens) - 1) // block_size
    if limit == 0 or not bool((block_tables[:, 0] == block_tables[0, 0]).all()):  # the usual answer, cheaply
        return 0
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)  # [limit] column equal in every row
    return int(same.int().cumprod(dim=0).sum())


def plan_sdpa(
    meta: AttentionMetadata, block_size: int, gather_decodes: bool = True, gather_chunks: bool = True
) -> SdpaPlan:
    """The decode runs with their block ids and masks, and each prefill chunk's blocks and causal mask.
    `gather_decodes=False` (the cpu backend, whose kernel reads decode rows in place): decode runs only for
    cascade attention, when the rows share a prefix. `gather_chunks=False` (the cpu backend's chunk kernel, which
    reads the blocks in place too): chunks without blocks or masks."""
    dev = meta.block_tables.device
    starts, lens, d = meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.num_decodes
    cascade = d >= CASCADE_MIN_ROWS and dev.type == "cpu"  # (the CPU flash kernel returns the log-sum-exp)
    k = common_prefix_blocks(meta.block_tables[:d], lens[:d], block_size) if cascade else 0
    k = k if k >= CASCADE_MIN_BLOCKS else 0
    own = [n - k * block_size for n in lens[:d]] if k else lens[:d]  # what each row has after the shared prefix
    runs = []
    for a, b, width in decode_runs(own, block_size) if gather_decodes or k else []:
        pos = torch.arange(width * block_size, device=dev)
        real = pos[None, :] < meta.seq_lens[a:b, None] - k * block_size  # [rows, L]
        blocks = meta.block_tables[a:b, k : k + width].reshape(-1).long()
        runs.append(DecodeRun(a, b, blocks, real[:, None, None, :]))
    chunks = []
    for i in range(d, len(lens)):
        s, e, L = starts[i], starts[i + 1], lens[i]
        if e - s == L or not gather_chunks:  # a first chunk: the context is exactly the new tokens
            chunks.append(PrefillChunk(s, e, L, None, None))
        else:  # a later chunk: earlier tokens are only in the pool
            pos = torch.arange(L, device=dev)
            causal = pos[None, :] <= pos[L - (e - s) :, None]  # [T, L]
            chunks.append(PrefillChunk(s, e, L, meta.block_tables[i, : -(-L // block_size)].long(), causal))
    return SdpaPlan(runs, chunks, meta.block_tables[0, :k].long() if k else None)


def _attend_run(q, k_cache, v_cache, run: DecodeRun, scale: float, buffer: GatherBuffer | None) -> torch.Tensor:
    """q [rows, H, D] -> [rows, H, D]: one block-granular gather of K and of V, then one fused SDPA call.
    A K/V head's G query heads are G query rows of it (GQA, see the module docstring; G = 1 for MHA)."""
    B, H, D = q.shape
    Hkv, L = k_cache.shape[2], run.real.shape[-1]  # padded context: every row is `width` blocks long
    k_blocks, v_blocks = (buffer or GatherBuffer()).get(len(run.blocks), k_cache)  # [rows * width, bs, Hkv, D]
    torch.index_select(k_cache, 0, run.blocks, out=k_blocks)  # block by block, in logical order
    torch.index_select(v_cache, 0, run.blocks, out=v_blocks)
    k = dequantize(k_blocks, q.dtype).view(B, L, Hkv, D).transpose(1, 2)  # [B, Hkv, L, D], a view (fp8: a copy)
    v = dequantize(v_blocks, q.dtype).view(B, L, Hkv, D).transpose(1, 2)
    q_groups = q.unflatten(1, (Hkv, kv_groups(H, k_cache)))  # [B, Hkv, G, D], a view
    out = F.scaled_dot_product_attention(q_groups, k, v, attn_mask=run.real, scale=scale)  # [B, Hkv, G, D]
    return out.flatten(1, 2)  # [B, H, D]


def attend_cascade(q, k_cache, v_cache, plan: SdpaPlan, scale: float, buffer: GatherBuffer | None) -> torch.Tensor:
    """Decode rows that all start with the same cached blocks (cascade attention, as in vLLM and FlashInfer):
    the shared prefix is read once and attended by every row at once, each row's own tokens after it
    separately, and the two softmaxes are merged through their log-sum-exps:

        out = o_prefix · exp(lse_prefix - lse) + o_own · exp(lse_own - lse),   lse = logaddexp(lse_prefix, lse_own)

    Without it, 32 requests behind a 384-token system prompt gather those 384 tokens' K/V 32 times a layer.
    Both parts run on PyTorch's CPU flash-attention kernel, the one F.scaled_dot_product_attention calls
    on a CPU, called directly because it also returns the log-sum-exp (an internal op of torch 2.13).
    With GQA both parts fold a K/V head's G query heads into its query rows, as `_attend_run` does.
    """
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = kv_groups(H, k_cache)
    k_p = dequantize(k_cache.index_select(0, plan.prefix_blocks), q.dtype).flatten(0, 1).transpose(0, 1)  # [Hkv, Lp, D]
    v_p = dequantize(v_cache.index_select(0, plan.prefix_blocks), q.dtype).flatten(0, 1).transpose(0, 1)
    # all B queries (B * G per K/V head) against the prefix, as one sequence with no mask (every prefix token is
    # visible): row b * G + g of K/V head j is query head j * G + g of row b
    q_p = q.unflatten(1, (Hkv, G)).transpose(0, 1).reshape(Hkv, B * G, D)  # [Hkv, B * G, D]
    o_p, lse_p = _flash_with_lse(q_p[None], k_p[None], v_p[None], None, scale)  # [1, Hkv, B * G, D|1]
    o_p = o_p[0].unflatten(1, (B, G)).transpose(0, 1).flatten(1, 2)  # [Hkv, B, G, D] -> [B, H, D]
    lse_p = lse_p[0].unflatten(1, (B, G)).transpose(0, 1).flatten(1, 2)  # [B, H]
    out = torch.empty_like(q)
    for run in plan.decode_runs:  # the rows' own tokens, padded to the run's longest, masked
        rows, L = run.b - run.a, run.real.shape[-1]
        k_blocks, v_blocks = (buffer or GatherBuffer()).get(len(run.blocks), k_cache)
        torch.index_select(k_cache, 0, run.blocks, out=k_blocks)
        torch.index_select(v_cache, 0, run.blocks, out=v_blocks)
        k = dequantize(k_blocks, q.dtype).view(rows, L, Hkv, D).transpose(1, 2)  # [rows, Hkv, L, D]
        v = dequantize(v_blocks, q.dtype).view(rows, L, Hkv, D).transpose(1, 2)
        bias = torch.zeros(run.real.shape, dtype=q.dtype, device=q.device).masked_fill(~run.real, float("-inf"))
        q_o = q[run.a : run.b].unflatten(1, (Hkv, G))  # [rows, Hkv, G, D]
        o_o, lse_o = _flash_with_lse(q_o, k, v, bias, scale)  # [rows, Hkv, G, D], [rows, Hkv, G]
        o_o, lse_o, lse_pr = o_o.flatten(1, 2), lse_o.flatten(1, 2), lse_p[run.a : run.b]  # [rows, H, D], [rows, H]
        lse = torch.logaddexp(lse_pr, lse_o)  # [rows, H]
        out[run.a : run.b] = (
            o_p[run.a : run.b] * torch.exp(lse_pr - lse)[..., None] + o_o * torch.exp(lse_o - lse)[..., None]
        )
    return out


def _flash_with_lse(q, k, v, bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale + bias) v and its log-sum-exp: [B, H, T, D] x [B, H, L, D] -> [B, H, T, D], [B, H, T]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)


def paged_decode_sdpa(
    q: torch.Tensor,  # [B, H, D] one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int, padded with a real block id (0)
    seq_lens: torch.Tensor,  # [B] int, tokens each sequence attends to
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Decode attention for a batch in one call (the signature of `paged_attention_reference`)."""
    L = block_tables.shape[1] * k_cache.shape[1]
    real = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    run = DecodeRun(0, len(q), block_tables.reshape(-1).long(), real[:, None, None, :])
    return _attend_run(q, k_cache, v_cache, run, scale, None)


SPLIT_COST_BLOCKS = 16  # one more gather + SDPA call costs about as much as copying this many padding blocks


def decode_runs(seq_lens: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """Cut decode rows, sorted longest first, into runs (first row, end row, blocks per row).

    One call pads every row to the longest, so a batch of 250- and 20-token sequences gathers and
    attends to ~12 blocks of padding per short row. A new run starts at a row that needs at most 3/4
    of the run's blocks, if the rows left would save more padding than one more call costs:

        blocks per row  16 16 15 14 | 8 8 7 7 7 6 | 2 2 1 1 1 1     three calls instead of one
    """
    blocks = [-(-n // block_size) for n in seq_lens]
    if not blocks:
        return []
    top, bottom = max(blocks), min(blocks)
    if 4 * bottom > 3 * top or (top - bottom) * len(blocks) <= SPLIT_COST_BLOCKS:
        return [(0, len(blocks), top)]  # no row is short enough to be worth a call of its own
    cuts = [0]
    for i in range(1, len(blocks)):
        top = blocks[cuts[-1]]  # the run's longest row
        if 4 * blocks[i] <= 3 * top and (top - blocks[i]) * (len(blocks) - i) > SPLIT_COST_BLOCKS:
            cuts.append(i)
    ends = [*cuts[1:], len(blocks)]
    return [(a, b, max(blocks[a:b])) for a, b in zip(cuts, ends, strict=True)]  # max: right even if unsorted


def attention_sdpa(
    q: torch.Tensor,  # [N, H, D] this step's queries, decodes first
    key: torch.Tensor,  # [N, Hkv, D] this step's keys (already written into the pool too)
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: Callable[..., torch.Tensor] | None = None,
    chunk_kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:  # [N, H, D]
    """A mixed batch: the decodes in a few calls (runs of similar length), then each prefill chunk on its own.
    With `decode_kernel` (the cpu backend: `cpu_paged.paged_decode_cpu`), the decodes go to that kernel in one
    call, which reads the blocks where they lie, unless they share a prefix long enough for cascade attention;
    with `chunk_kernel` (`cpu_paged.paged_prefill_cpu`) each prefill chunk goes to that kernel, which reads its
    context in place too (the plan then holds no chunk blocks or masks)."""
    plan = meta.plan if isinstance(meta.plan, SdpaPlan) else plan_sdpa(meta, k_cache.shape[1], decode_kernel is None)
    out = torch.empty_like(q)
    d = meta.num_decodes
    if plan.prefix_blocks is not None:  # many decodes share a cached prefix
        out[:d] = attend_cascade(q[:d], k_cache, v_cache, plan, scale, meta.gather_buffer)
    elif decode_kernel is not None and d:
        out[:d] = decode_kernel(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d], scale)
    else:
        for run in plan.decode_runs:
            out[run.a : run.b] = _attend_run(q[run.a : run.b], k_cache, v_cache, run, scale, meta.gather_buffer)
    for i, c in enumerate(plan.chunks, start=d):  # chunk i is request i's
        if chunk_kernel is not None:
            out[c.s : c.e] = chunk_kernel(q[c.s : c.e], k_cache, v_cache, meta.block_tables[i], c.seq_len, scale)
            continue
        out[c.s : c.e] = _attend_chunk(q[c.s : c.e], key[c.s : c.e], value[c.s : c.e], k_cache, v_cache, c, scale)
    return out


def _attend_chunk(q, key, value, k_cache, v_cache, c: PrefillChunk, scale: float) -> torch.Tensor:
    """One prefill chunk, q [T, H, D] -> [T, H, D]; key/value [T, Hkv, D] are its fresh K/V."""
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = kv_groups(H, k_cache)
    if c.blocks is None:  # a first chunk: its own fresh K/V, plain causal attention
        k_c, v_c = key.transpose(0, 1), value.transpose(0, 1)  # [Hkv, T, D]
        if G > 1:  # is_causal needs one K/V head per query head: repeat each G times (T tokens' K/V, a small copy)
            k_c, v_c = k_c.repeat_interleave(G, dim=0), v_c.repeat_interleave(G, dim=0)  # [H, T, D]
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k_c, v_c, is_causal=True, scale=scale)  # [H, T, D]
        return y.transpose(0, 1)  # [T, H, D]
    # a later chunk: its whole context, gathered from the pool
    k_c = dequantize(k_cache.index_select(0, c.blocks), q.dtype).flatten(0, 1)[: c.seq_len].transpose(0, 1)  # [Hkv,L,D]
    v_c = dequantize(v_cache.index_select(0, c.blocks), q.dtype).flatten(0, 1)[: c.seq_len].transpose(0, 1)
    if G == 1:
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k_c, v_c, attn_mask=c.causal, scale=scale)  # [H, T, D]
        return y.transpose(0, 1)  # [T, H, D]
    # GQA: a K/V head's G query heads become G * T query rows of it, row g * T + t = query head kv * G + g of token t
    q_g = q.unflatten(1, (Hkv, G)).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)  # [Hkv, G * T, D], a small copy
    mask = c.causal.repeat(G, 1)  # [G * T, L]: row g * T + t is token t's causal row
    y = F.scaled_dot_product_attention(q_g, k_c, v_c, attn_mask=mask, scale=scale)  # [Hkv, G * T, D]
    return y.unflatten(1, (G, T)).permute(2, 0, 1, 3).reshape(T, H, D)  # [Hkv, G, T, D] -> [T, H, D]
