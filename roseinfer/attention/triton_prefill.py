"""Prefill attention in Triton: many queries per request, over the paged cache (chunked prefill included).

The decode kernel (triton_kernels.py) has ONE query per sequence: a program holds a [D] query and walks the keys.
A prefill chunk has q_len new tokens per request, all attending to the same keys, so a program here
holds a *tile* of BLOCK_M queries and every key tile it loads is used by all of them:

    scores = q_tile @ k_tile^T      [BLOCK_M, D] @ [D, BLOCK_N] -> [BLOCK_M, BLOCK_N]   (tl.dot)
    acc   += p @ v_tile             [BLOCK_M, BLOCK_N] @ [BLOCK_N, D] -> [BLOCK_M, D]   (tl.dot)

`tl.dot` is a small matrix multiply that the GPU runs on its matrix units; this reuse is what makes
prefill compute-bound where decode is memory-bound. (See `triton_kernels.py` for how to read a kernel.)

The batch (vLLM's names): the queries of all requests are flattened, request after request, into
q [Nq, H, D]. Request b owns rows `query_start_loc[b] : query_start_loc[b + 1]` (q_len of them) and has
seq_len = seq_lens[b] tokens after this step, its new ones last. So query i sits at position
context_len + i, with context_len = seq_len - q_len tokens (earlier chunks) already in the cache:

    position:  0 1 2 ... context_len-1 | context_len ... seq_len-1
               earlier chunks (cached)  | this chunk: the q_len queries (their K/V already written too)

Query at position p sees keys 0 .. p (causal). A fresh prompt is context_len = 0; a decode is q_len = 1.

Grouped-query attention: the pools hold Hkv = H / G heads, [num_blocks, block_size, Hkv, D], and the
program of query head h reads K/V head h // G, as the decode kernel does (see triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roseinfer.attention.triton_kernels import _check_cache, _kv_groups, paged_attention_auto

_MAX_BLOCK_M = 64  # the largest query tile; a module constant so tests can shrink it to get many tiles


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [Nq, H, D]
    q_ptr,  # [Nq, H, D] (last dim contiguous)
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], same strides as k_cache
    block_tables_ptr,  # [Bp, max_blocks] int32
    query_start_loc_ptr,  # [Bp + 1] int32, starting at 0
    seq_lens_ptr,  # [Bp] int32
    scale,
    num_queries_per_kv,  # G = H // Hkv: query head h reads K/V head h // G (1 for MHA)
    stride_qn,  # elements between two tokens of q
    stride_qh,
    stride_on,
    stride_oh,
    stride_table,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,  # D, a power of two >= 16 (tl.dot needs every tile dim >= 16)
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step of the loop; need not equal BLOCK_SIZE
    DOT_PRECISION: tl.constexpr,  # "ieee" (exact fp32) or "tf32" (tensor cores), see the wrapper
):
    # The grid is (Bp, H, cdiv(max_query_len, BLOCK_M)): one program computes BLOCK_M queries of one head
    # of one request. The third axis is sized for the longest chunk, so a short chunk has idle programs.
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // num_queries_per_kv  # the pool's head this query head reads (GQA)
    q_start = tl.load(query_start_loc_ptr + req)  # this request's first row of q
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start  # its number of new tokens
    if tile * BLOCK_M >= q_len:  # this tile lies entirely past the chunk: nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens cached before this chunk (0 for a fresh prompt)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index of each query inside the chunk
    row_valid = rows < q_len  # [BLOCK_M] the last tile usually hangs over the end of the chunk
    q_pos = context_len + rows  # [BLOCK_M] position of each query in its sequence
    dims = tl.arange(0, HEAD_DIM)  # [D]
    keys = tl.arange(0, BLOCK_N)  # [BLOCK_N] offsets of the keys inside one key tile

    # [BLOCK_M, 1] + [1, D] -> [BLOCK_M, D] offsets: row r of the tile is token q_start + r of q.
    q_offs = (q_start + rows).to(tl.int64)[:, None] * stride_qn + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, D]

    # The decode kernel's online softmax (`_attend_blocks`), now with one running (m, l, acc) per query row.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exps
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BLOCK_M, D] running weighted sum of V rows

    # Causal upper bound: the last real query of this tile is at position context_len + min(...) - 1, so
    # no row of the tile sees a key at or past key_end (<= seq_len). Stopping there skips the keys of later
    # tiles' queries: on a long fresh prompt that halves the work, and a tile never reads past its own rows.
    key_end = context_len + tl.minimum((tile + 1) * BLOCK_M, q_len)
    table_ptr = block_tables_ptr + req * stride_table  # this request's row of block_tables
    for start in range(0, key_end, BLOCK_N):  # a runtime bound: one loop for every chunk length
        key_pos = start + keys  # [BLOCK_N] positions of these keys in the sequence
        key_valid = key_pos < key_end  # [BLOCK_N] False past the end: those lanes are never loaded

        # Paging, one key at a time: key_pos // BLOCK_SIZE is its logical block, the table gives the
        # physical one. So a key tile may span several KV blocks (BLOCK_SIZE < BLOCK_N) or part of one.
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)  # [BLOCK_N]
        slot = block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot  # [BLOCK_N]
        kv_offs = (slot + kv_head * stride_cache_head)[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = tl.load(k_cache_ptr + kv_offs, mask=key_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + kv_offs, mask=key_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]

        # [BLOCK_M, D] @ [D, BLOCK_N]: every query of the tile against every key of the tile at once.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        # Causal mask: query at q_pos sees keys 0 .. q_pos. key_valid also drops keys >= seq_len, since
        # key_end <= seq_len (rows past the chunk have q_pos >= seq_len: they see all, and are not stored).
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]  # [BLOCK_M, BLOCK_N]
        scores = tl.where(visible, scores, float("-inf"))

        # Key 0 is visible to every row and lies in the first key tile, so m_new is finite from the start:
        # no exp(-inf - -inf) = NaN. A later tile that is fully masked for a row just adds p = 0 there.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_M]
        alpha = tl.exp(m_i - m_new)  # [BLOCK_M] how much each row's old terms shrink
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N] unnormalised probabilities
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)  # [BLOCK_M, D]
        m_i = m_new

    out = acc / l_i[:, None]  # [BLOCK_M, D] normalise once at the end
    o_offs = (q_start + rows).to(tl.int64)[:, None] * stride_on + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_attention_triton(
    q: torch.Tensor,  # [Nq, H, D] queries of the prefill requests only, flattened
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], H % Hkv == 0
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [Bp, max_blocks] int32
    query_start_loc: torch.Tensor,  # [Bp + 1] int32, starting at 0
    seq_lens: torch.Tensor,  # [Bp] int32
    max_query_len: int,  # a host int: the grid size (no device sync in the wrapper)
    scale: float,
    out: torch.Tensor | None = None,  # [Nq, H, D], written in place if given (may be a slice of a bigger buffer)
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole paged context (earlier chunks + this one).

    Grid (Bp, H, cdiv(max_query_len, BLOCK_M)); `max_query_len` must be >= every request's q_len (rows of a
    longer chunk would be left unwritten). The lengths stay on the device: the wrapper never reads them.
    """
    G = _check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len)
    Nq, H, D = q.shape
    Bp = seq_lens.shape[0]
    out = torch.empty((Nq, H, D), dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1, "out must be [Nq, H, D] with a contiguous last dim"
    assert out.device == q.device, "out must be on q's device"
    if Nq == 0 or Bp == 0:
        return out
    # Tile sizes are powers of two >= 16 (tl.dot). A short chunk gets a short query tile (fewer idle rows).
    # With blocks of 16 to 64 tokens a key tile is exactly one KV block, its rows contiguous in memory;
    # smaller blocks share a 16-key tile, bigger ones are walked 64 keys at a time.
    block_m = min(_MAX_BLOCK_M, max(16, triton.next_power_of_2(max_query_len)))
    block_n = max(16, min(k_cache.shape[1], 64))
    # fp32 models must match the torch path token for token: exact fp32 dots (on CUDA cores). fp16/bf16
    # values are exact in tf32 (10-bit mantissa) and the scale is applied after the dot, so q and k enter
    # the tensor cores unchanged; only p is cut to tf32 (~1e-3 relative). The interpreter ignores this.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The fp32 q tile and acc live in registers: at [64, 128] each, 4 warps spill (ptxas for sm_80/90), 8 do not.
    num_warps = 8 if block_m * D > 64 * 64 else 4
    grid = (Bp, H, triton.cdiv(max_query_len, block_m))
    _prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, G,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip
    return out


def attention_triton(
    q: torch.Tensor,  # [N, H, D] decodes' queries first (one each), then the prefill chunks'
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the new tokens' K/V already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_decodes: int,  # the first num_decodes requests have q_len == 1
    max_query_len: int,  # >= every q_len of the batch (a host int)
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D]
) -> torch.Tensor:
    """A whole mixed batch, as `attention_reference`: decodes -> the decode kernel, the rest -> prefill.

    Both kernels write into slices of one `out`, so the forward pass sees a single [N, H, D] result.
    """
    N, H, D = q.shape
    B = seq_lens.shape[0]
    assert 0 <= num_decodes <= B, f"num_decodes must be in [0, {B}], got {num_decodes}"
    assert query_start_loc.shape == (B + 1,), "query_start_loc must be [B + 1]"
    if not query_start_loc.is_cuda:  # free on the CPU (the interpreter); on CUDA it would be a device sync
        assert query_start_loc[num_decodes].item() == num_decodes, "the first num_decodes requests must be decodes"
    out = torch.empty((N, H, D), dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape, "out must be [N, H, D]"
    d = num_decodes
    if d > 0:  # one query per sequence, its context = seq_len (the new token included)
        paged_attention_auto(q[:d], k_cache, v_cache, block_tables[:d], seq_lens[:d], scale, out=out[:d])
    if d < B:  # the chunks, renumbered so that their first query is row 0 (a device op, no sync)
        prefill_attention_triton(
            q[d:], k_cache, v_cache, block_tables[d:], query_start_loc[d:] - query_start_loc[d], seq_lens[d:],
            max_query_len, scale, out=out[d:],
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Argument checks (shared with the decode kernel): a wrong stride or a too-small grid is a silent wrong answer.
# --------------------------------------------------------------------------------------------------


def _check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len) -> int:
    """Checks the arguments of a prefill launch; returns G, the query heads per K/V head."""
    assert q.dim() == 3, "q must be [Nq, H, D]"
    Nq, H, D = q.shape
    G = _kv_groups(q, k_cache)
    _check_cache(k_cache, v_cache, H // G, D)
    assert D >= 16, f"head_dim must be >= 16 (tl.dot tiles), got {D}"
    assert q.stride(-1) == 1, "the head dim of q must be contiguous"
    assert seq_lens.dim() == 1 and seq_lens.stride(0) == 1, "seq_lens must be a contiguous [Bp]"
    Bp = seq_lens.shape[0]
    assert query_start_loc.shape == (Bp + 1,) and query_start_loc.stride(0) == 1, "query_start_loc must be [Bp + 1]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == Bp and block_tables.stride(1) == 1, (
        "block_tables must be [Bp, max_blocks] with contiguous rows"
    )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        assert not t.is_floating_point() and not t.is_complex(), f"{name} must be an integer tensor"
        assert t.device == q.device, f"{name} must be on q's device ({q.device}), got {t.device}"
    assert isinstance(max_query_len, int) and max_query_len >= 1, f"max_query_len must be an int >= 1: {max_query_len}"
    if not q.is_cuda and Bp > 0:  # the metadata is on the host: checking its values costs no device sync
        starts = query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]  # [Bp]
        assert starts[0] == 0 and starts[-1] == Nq, f"query_start_loc must run from 0 to Nq = {Nq}"
        assert bool((q_lens >= 1).all()), "every request needs q_len >= 1"
        assert int(q_lens.max()) <= max_query_len, f"max_query_len {max_query_len} < the longest q_len"
        assert bool((seq_lens.long() >= q_lens).all()), "seq_lens must include the new tokens (seq_len >= q_len)"
        blocks_needed = (seq_lens.long() + k_cache.shape[1] - 1) // k_cache.shape[1]
        assert int(blocks_needed.max()) <= block_tables.shape[1], "block_tables has too few columns for seq_lens"
    return G
