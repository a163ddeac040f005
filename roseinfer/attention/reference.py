"""Paged attention in plain PyTorch: runs on CPU and CUDA, and is the oracle for faster kernels.

The KV cache of one layer is a pool of fixed-size blocks shared by every sequence:

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]

A token's K/V vectors live in one *slot* of the pool, `slot = block_id * block_size + offset`.
A sequence owns a list of blocks (its row of `block_tables`); logical token `t` of sequence `b`
lives in physical block `block_tables[b, t // block_size]` at offset `t % block_size`.

Grouped-query attention (GQA): the pools may hold fewer heads than the queries have, Hkv <= H with
H % Hkv == 0. G = H // Hkv query heads share one K/V head: query head h reads K/V head h // G (Hugging
Face's `repeat_kv`). Hkv == H is plain multi-head attention (MHA), Hkv == 1 multi-query attention (MQA).
The reference gathers the Hkv heads and repeats each G times (`repeat_interleave`), so that from there on
it is MHA; the faster backends get the same result without that copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_groups(num_heads: int, k_cache: torch.Tensor) -> int:
    """G = H // Hkv, the query heads per K/V head, with Hkv read from the pool [num_blocks, block_size, Hkv, D]."""
    num_kv_heads = k_cache.shape[-2]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} K/V heads: H % Hkv must be 0")
    return num_heads // num_kv_heads


def write_kv_reference(
    key: torch.Tensor,  # [N, Hkv, D] K of the N new tokens
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [N] int, physical slot of each token; < 0 means "padding, skip"
) -> None:
    """Scatter the new tokens' K/V into their slots of the pool (vLLM's `reshape_and_cache`)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # [N] bool
    # Boolean indexing keeps only the real tokens (on CUDA it costs one host sync: fine for a reference).
    slots = slot_mapping[valid].long()  # [n] with n <= N
    blocks, offsets = slots // block_size, slots % block_size  # [n], [n]
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)  # each token writes one [Hkv, D] slice
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,  # [B, H, D] one query token per sequence (decode)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int, physical block of each logical block
    context_lens: torch.Tensor,  # [B] int, tokens each sequence attends to (>= 1, the new one included)
    scale: float,  # usually 1 / sqrt(D)
) -> torch.Tensor:  # [B, H, D], dtype of q
    """Decode attention over a paged KV cache, for the whole batch at once (no loop over sequences).

    1. Gather: `k_cache[block_tables]` copies each sequence's blocks, in logical order, into a
       dense [B, max_blocks * block_size, Hkv, D] tensor (padded to the longest block table), then
       each K/V head is repeated G times, so that query head h meets K/V head h // G (GQA).
    2. Mask: positions >= context_len hold stale data from earlier owners (in tests even NaN),
       so they are excluded from the softmax, and zeroed first (NaN + -inf and 0 * NaN are NaN).
    3. Attention in fp32 with `scaled_dot_product_attention`, cast back to q's dtype.
    """
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = kv_groups(H, k_cache)
    max_blocks = block_tables.shape[1]
    lens = context_lens.long()  # [B]

    # Table entries past a sequence's last block may hold anything: point them at block 0 so the gather is safe.
    n_blocks = (lens + block_size - 1) // block_size  # [B] blocks in use per sequence
    used = torch.arange(max_blocks, device=q.device)[None, :] < n_blocks[:, None]  # [B, max_blocks]
    tables = torch.where(used, block_tables.long(), 0)  # [B, max_blocks]

    L = max_blocks * block_size  # padded context length
    k = k_cache[tables].reshape(B, L, Hkv, D).transpose(1, 2).float()  # [B, max_blocks, bs, Hkv, D] -> [B, Hkv, L, D]
    v = v_cache[tables].reshape(B, L, Hkv, D).transpose(1, 2).float()  # [B, Hkv, L, D]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, H, L, D]: heads 0,0,1,1,.. for G = 2
    valid = torch.arange(L, device=q.device)[None, :] < lens[:, None]  # [B, L] True for real tokens
    k, v = (torch.where(valid[:, None, :, None], t, 0.0) for t in (k, v))  # [B, H, L, D]: no NaN in masked slots
    mask = valid[:, None, None, :]  # [B, 1, 1, L]: one query per sequence, attending to its own tokens
    out = F.scaled_dot_product_attention(q.float()[:, :, None, :], k, v, attn_mask=mask, scale=scale)  # [B, H, 1, D]
    return out[:, :, 0].to(q.dtype)


def grouped_decode_reference(
    q: torch.Tensor,  # [B, H, D] one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int, tokens each sequence attends to (>= 1)
    scale: float,
    chunk: int = 256,  # tokens per tile, as the C++ kernel's kChunk
) -> torch.Tensor:  # [B, H, D], dtype of q
    """The C++ decode kernel's algorithm (roseinfer/csrc/paged_attention.cpp), in PyTorch, one K/V head at a time.

    For one sequence's K/V head j and the G query heads that read it (h = j * G .. j * G + G - 1), the tokens
    are taken `chunk` at a time, read in place through the block table, and each K and V row meets all G query
    rows at once; the softmax is an online one (running max m, running sum `total`). (The kernel's item is the
    whole sequence, its Hkv heads one after another per token, so that a token's K/V is one contiguous read;
    the arithmetic per head is this.)

        S     = q_g · Kᵀ            [G, n]  the score tile: G dot products per K row
        m'    = max(m, rowmax S)            acc and total rescaled by exp(m - m') when the max grows
        P     = exp(S - m')         [G, n]
        acc   = acc · exp(m - m') + P · V   [G, D]
        total = total · exp(m - m') + rowsum P
        out   = acc / total

    In fp32, whatever the pool's dtype. Slow (Python loops over items and tiles): it shows the loop, and the
    tests check the kernel against it and against `paged_attention_reference`.
    """
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = kv_groups(H, k_cache)
    out = torch.empty_like(q)
    for b in range(B):
        n_tokens = int(context_lens[b])
        positions = torch.arange(n_tokens, device=q.device)
        slots = block_tables[b, positions // block_size].long() * block_size + positions % block_size  # [n_tokens]
        for j in range(Hkv):
            q_g = q[b, j * G : (j + 1) * G].float() * scale  # [G, D]
            m = torch.full((G, 1), float("-inf"), device=q.device)
            total = torch.zeros(G, 1, device=q.device)
            acc = torch.zeros(G, D, device=q.device)
            for t0 in range(0, n_tokens, chunk):
                k = k_cache.view(-1, Hkv, D)[slots[t0 : t0 + chunk], j].float()  # [n, D], read in place
                v = v_cache.view(-1, Hkv, D)[slots[t0 : t0 + chunk], j].float()
                s = q_g @ k.T  # [G, n]
                m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # [G, 1]
                p = torch.exp(s - m_new)  # [G, n]
                rescale = torch.exp(m - m_new)  # [G, 1]: 0 on the first tile (m = -inf)
                acc = acc * rescale + p @ v
                total = total * rescale + p.sum(dim=-1, keepdim=True)
                m = m_new
            out[b, j * G : (j + 1) * G] = (acc / total).to(q.dtype)
    return out


def attention_reference(
    q: torch.Tensor,  # [N, H, D] the new tokens' queries, request after request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the new tokens' K already written
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int, physical block of each logical block
    query_start_loc: torch.Tensor,  # [B + 1] int, request b's queries: q[query_start_loc[b] : query_start_loc[b + 1]]
    seq_lens: torch.Tensor,  # [B] int, tokens in each request's context after this step (earlier + new)
    scale: float,
) -> torch.Tensor:  # [N, H, D], dtype of q
    """Attention for a mixed batch (decodes and prefill chunks) over the paged cache, one request at a time.

    Request b has q_len = query_start_loc[b + 1] - query_start_loc[b] new tokens, the LAST q_len of its
    seq_lens[b] tokens: query i sits at position seq_len - q_len + i and may look at keys 0 .. that position.
    A decode is q_len = 1; a first prefill chunk is q_len = seq_len; a later chunk has context before it.
    """
    N, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = kv_groups(H, k_cache)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    for b, seq_len in enumerate(lens):
        q_b = q[starts[b] : starts[b + 1]].float()  # [T, H, D]
        T = q_b.shape[0]
        pos = torch.arange(seq_len, device=q.device)  # [L] every position of the context
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size  # [L]
        k = k_cache.reshape(-1, Hkv, D)[slots].float()  # [L, Hkv, D], only this request's real tokens
        v = v_cache.reshape(-1, Hkv, D)[slots].float()
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [L, H, D]: head h reads K/V head h // G
        q_pos = torch.arange(seq_len - T, seq_len, device=q.device)  # [T] positions of the queries
        causal = pos[None, :] <= q_pos[:, None]  # [T, L]
        scores = torch.einsum("thd,lhd->htl", q_b, k) * scale  # [H, T, L]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[starts[b] : starts[b + 1]] = torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def copy_blocks_reference(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per layer, each [num_blocks, block_size, Hkv, D]
    block_mapping: torch.Tensor,  # [P, 2] int64: copy physical block src -> dst, in every layer's K and V
) -> None:
    """Copy whole blocks inside the pools, in every layer (vLLM's `copy_blocks`): the copy of copy-on-write.

    After a fork, sequences share KV blocks. Before one of them appends a token into a shared, partly filled
    block, it gets a fresh block `dst`, and `src`'s tokens must be copied there first. A step's copies arrive
    together as rows (src, dst) of `block_mapping`; a block id names the same block in every layer, so the one
    list is applied to every layer's K and V pool, before the forward writes the new tokens.

    The dst blocks are fresh: no pair's dst is another pair's src or dst (a src may repeat: one block copied for
    two sequences). So the copies are independent and their order cannot matter. Otherwise it would: with
    a -> b and b -> c, this reference (all reads, then all writes) gives c the OLD b, a kernel that runs pairs in
    parallel gives c old b, new b or a torn mix of both, whichever its programs happen to race to; two pairs
    with one dst race the same way. `check_copy_blocks_args` rejects such a mapping when it is on the CPU.
    """
    check_copy_blocks_args(kv_caches, block_mapping)
    mapping = block_mapping.to(kv_caches[0][0].device, torch.long)  # [P, 2]
    src, dst = mapping[:, 0], mapping[:, 1]  # [P], [P]
    for k_cache, v_cache in kv_caches:
        # `k_cache[src]` gathers a [P, block_size, Hkv, D] copy of every src block, then one scatter writes them all.
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def check_copy_blocks_args(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: torch.Tensor) -> None:
    """Fail loudly on what a block copy would get silently wrong (shared by the reference and the kernel).

    The block ids themselves (in range, fresh dsts) are checked only when `block_mapping` is on the CPU, as
    the scheduler builds it: reading a GPU tensor's values would stall the host until the GPU catches up.
    """
    if not kv_caches:
        raise ValueError("copy_blocks: kv_caches is empty; expected one (k_cache, v_cache) pool pair per layer")
    k0 = kv_caches[0][0]
    if k0.dim() != 4:
        raise ValueError(
            f"copy_blocks: pools must be [num_blocks, block_size, H, D] (H = Hkv, the K/V heads), got {tuple(k0.shape)}"
        )
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (t.shape, t.dtype, t.device) != (k0.shape, k0.dtype, k0.device):
                raise ValueError(
                    f"copy_blocks: layer {layer}'s {name} is {tuple(t.shape)} {t.dtype} on {t.device}, but layer 0's "
                    f"k_cache is {tuple(k0.shape)} {k0.dtype} on {k0.device}: every pool must match"
                )
    if not isinstance(block_mapping, torch.Tensor) or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        got = tuple(block_mapping.shape) if isinstance(block_mapping, torch.Tensor) else type(block_mapping).__name__
        raise ValueError(f"copy_blocks: block_mapping must be a [P, 2] tensor of (src, dst) block ids, got {got}")
    if block_mapping.is_floating_point() or block_mapping.is_complex() or block_mapping.dtype == torch.bool:
        raise ValueError(f"copy_blocks: block_mapping must hold integer block ids, got {block_mapping.dtype}")
    if block_mapping.device.type != "cpu":
        return
    num_blocks = k0.shape[0]
    out_of_range = (block_mapping < 0) | (block_mapping >= num_blocks)  # [P, 2]
    if out_of_range.any():
        pair = out_of_range.any(dim=1).nonzero()[0, 0].item()
        raise ValueError(
            f"copy_blocks: pair {pair} {block_mapping[pair].tolist()} names a block outside 0..{num_blocks - 1}"
        )
    src, dst = block_mapping[:, 0], block_mapping[:, 1]  # [P], [P]
    if dst.unique().numel() != dst.numel():
        raise ValueError(f"copy_blocks: two pairs copy into the same dst block: dsts {dst.tolist()}")
    reused = dst[torch.isin(dst, src)]  # dsts that some pair also reads
    if reused.numel():
        raise ValueError(
            f"copy_blocks: block {reused[0].item()} is both a dst and a src; dst blocks must be fresh, "
            "or the result depends on the order the copies run in"
        )
