"""Stage 09 kernels: prefill attention over the paged cache (chunked prefill) equals `attention_reference`,
and `attention_reference` equals plain dense causal attention.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so the kernels run on CPU in Triton's interpreter:
shapes stay tiny. A batch is a list of (seq_len, q_len) requests: q_len = seq_len is a fresh prompt,
q_len < seq_len a later chunk with context_len = seq_len - q_len tokens cached before it, q_len = 1 a decode.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from roseinfer.attention import triton_prefill  # noqa: E402
from roseinfer.attention.reference import (  # noqa: E402
    attention_reference,
    paged_attention_reference,
    write_kv_reference,
)
from roseinfer.attention.triton_prefill import attention_triton, prefill_attention_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
# (atol, rtol). Under the interpreter all math is fp32; on a GPU the fp16/bf16 tiles go through tf32 dots.
HOST_ONLY = pytest.mark.skipif(DEVICE == "cuda", reason="values are checked only when the metadata is on the host")
TOL = {torch.float32: (1e-5, 0.0), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 1e-2)}


def make_batch(reqs, H, D, block_size, dtype, seed, unused="garbage"):
    """A mixed batch over a paged pool whose K/V for every context token is already written.

    reqs: [(seq_len, q_len), ...]. Physical blocks are handed out in a scrambled order; table entries
    past a request's last block point at a poison block; every slot that no request owns (spare blocks,
    the tail of a last block) holds `unused`: "garbage" (large finite values) or "nan".
    Returns a dict with the kernel arguments and each request's dense K/V [seq_len, H, D].
    """
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(s / block_size) for s, _ in reqs]
    num_blocks = sum(n_blocks) + 2  # two spare blocks nobody owns
    physical = torch.randperm(num_blocks, generator=g)
    poison = physical[-1].item()
    tables = torch.full((len(reqs), max(n_blocks) + 1), poison, dtype=torch.int32)  # one extra, unused column
    fill = float("nan") if unused == "nan" else 0.0
    k_cache = torch.full((num_blocks, block_size, H, D), fill)
    v_cache = torch.full_like(k_cache, fill)
    if unused == "garbage":
        k_cache.normal_(0, 100, generator=g)
        v_cache.normal_(0, 100, generator=g)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)

    dense_k, dense_v, slots, next_block = [], [], [], 0
    for b, (seq_len, _) in enumerate(reqs):
        tables[b, : n_blocks[b]] = physical[next_block : next_block + n_blocks[b]].int()
        next_block += n_blocks[b]
        pos = torch.arange(seq_len)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)  # [seq_len]
        dense_k.append(torch.randn(seq_len, H, D, generator=g).to(dtype))  # [seq_len, H, D]
        dense_v.append(torch.randn(seq_len, H, D, generator=g).to(dtype))
    write_kv_reference(torch.cat(dense_k), torch.cat(dense_v), k_cache, v_cache, torch.cat(slots))

    q_lens = [q for _, q in reqs]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)  # [N, H, D]
    to = lambda t: t.to(DEVICE)
    return dict(
        q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), block_tables=to(tables),
        query_start_loc=to(query_start_loc), seq_lens=to(torch.tensor([s for s, _ in reqs], dtype=torch.int32)),
        max_query_len=max(q_lens), dense_k=dense_k, dense_v=dense_v, scale=D**-0.5,
    )  # fmt: skip


def reference(batch):
    keys = ("q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "scale")
    return attention_reference(*(batch[k] for k in keys))


def run_prefill(batch, **kw):
    keys = ("q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "max_query_len", "scale")
    return prefill_attention_triton(*(batch[k] for k in keys), **kw)


def assert_close(out, expected, dtype):
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def edge_reqs(bs):
    """Hand-picked (seq_len, q_len): block boundaries, mid-block chunks, one token, two query tiles."""
    return [
        (bs, bs),  # a fresh prompt filling exactly one block
        (1, 1),  # a one-token prompt
        (2 * bs, bs),  # a later chunk that starts and ends on block boundaries
        (2 * bs + 3, 5),  # a later chunk that starts and ends mid-block
        (3 * bs, 1),  # a decode whose new token completes a block
        (70, 66),  # 66 queries > 64 = BLOCK_M: two query tiles, after 4 tokens of context
    ]


def random_reqs(rng: random.Random, bs: int, n: int, max_len: int = 50):
    """n random requests of the kinds the scheduler sends: fresh prompts, later chunks, decodes."""
    reqs = []
    for _ in range(n):
        kind = rng.choice(["fresh", "chunk", "decode", "aligned"])
        if kind == "fresh":
            q_len = rng.randint(1, max_len)
            reqs.append((q_len, q_len))
        elif kind == "chunk":  # context_len >= 1 tokens cached before it
            seq_len = rng.randint(2, max_len)
            reqs.append((seq_len, rng.randint(1, seq_len - 1)))
        elif kind == "decode":
            reqs.append((rng.randint(1, max_len), 1))
        else:  # context and chunk both whole blocks
            context, q_len = bs * rng.randint(1, 2), bs * rng.randint(1, 2)
            reqs.append((context + q_len, q_len))
    return reqs


# ---------------------------------------------------------------------------------------------
# The oracle against plain dense causal attention (pure PyTorch, fast)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_matches_dense_causal_attention(block_size):
    """A chunk's output must equal the last q_len rows of one full causal pass over its whole sequence."""
    H, D = 2, 16
    reqs = [(7, 7), (9, 3), (12, 1), (block_size, block_size - 1)]  # fresh, later chunk, decode, chunk after 1
    batch = make_batch(reqs, H, D, block_size, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    full_q = [torch.randn(s, H, D, generator=g).to(DEVICE) for s, _ in reqs]  # a query for every position
    batch["q"] = torch.cat(
        [fq[-q_len:] for fq, (_, q_len) in zip(full_q, reqs, strict=True)]
    )  # keep the chunk's queries
    out = reference(batch)

    starts = batch["query_start_loc"].tolist()
    for b, (_, q_len) in enumerate(reqs):
        qkv = [t.transpose(0, 1).float().to(DEVICE) for t in (full_q[b], batch["dense_k"][b], batch["dense_v"][b])]
        dense = F.scaled_dot_product_attention(*qkv, is_causal=True, scale=batch["scale"])  # [H, L, D]
        expected = dense.transpose(0, 1)[-q_len:]  # [q_len, H, D]: the chunk's rows of the full pass
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected, atol=1e-5, rtol=0)
    # The first query of a fresh prompt sees only key 0: its output is exactly v_0.
    torch.testing.assert_close(out[0], batch["dense_v"][0][0].to(DEVICE), atol=1e-6, rtol=0)


def test_reference_decode_rows_match_stage_08_reference():
    reqs = [(5, 1), (16, 1), (33, 1)]
    batch = make_batch(reqs, 3, 16, 8, torch.float32, seed=5)
    decode = paged_attention_reference(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"], batch["scale"]
    )
    torch.testing.assert_close(reference(batch), decode, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# prefill_attention_triton against the oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_prefill_edge_cases_match_reference(block_size):
    reqs = edge_reqs(block_size)
    batch = make_batch(reqs, 2, 16, block_size, torch.float32, seed=block_size)
    assert_close(run_prefill(batch), reference(batch), torch.float32)


SWEEP = [  # (seed, block_size, H, D, dtype): random ragged batches
    (0, 4, 2, 16, torch.float32),
    (1, 8, 3, 32, torch.float32),
    (2, 16, 2, 32, torch.float32),
    (3, 32, 2, 16, torch.float32),
    (4, 4, 2, 32, torch.float16),
    (5, 16, 3, 16, torch.float16),
    (6, 8, 2, 16, torch.bfloat16),
    (7, 32, 2, 32, torch.bfloat16),
]


@pytest.mark.parametrize("seed, block_size, H, D, dtype", SWEEP)
def test_prefill_random_batches_match_reference(seed, block_size, H, D, dtype):
    rng = random.Random(seed)
    reqs = random_reqs(rng, block_size, n=rng.randint(1, 4))
    batch = make_batch(reqs, H, D, block_size, dtype, seed=seed)
    assert_close(run_prefill(batch), reference(batch), dtype)


def test_prefill_many_query_tiles(monkeypatch):
    """With BLOCK_M = 16: chunks span up to 3 query tiles, and short chunks leave programs that return early."""
    monkeypatch.setattr(triton_prefill, "_MAX_BLOCK_M", 16)
    reqs = [(40, 40), (50, 33), (9, 2), (17, 1), (48, 16)]
    batch = make_batch(reqs, 2, 16, 8, torch.float32, seed=21)
    assert_close(run_prefill(batch), reference(batch), torch.float32)


def test_prefill_nan_in_unowned_slots_does_not_leak():
    """Spare blocks, block tails past seq_len and the poison block all NaN: the kernel never loads them."""
    reqs = [(13, 13), (20, 7), (9, 1), (40, 24)]
    batch = make_batch(reqs, 2, 16, 8, torch.float16, seed=8, unused="nan")
    out = run_prefill(batch)
    assert torch.isfinite(out).all()
    assert_close(out, reference(batch), torch.float16)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the rows past tile 0 are meant to be NaN
def test_prefill_tile_never_reads_keys_past_its_own_queries(monkeypatch):
    """Causal upper bound: with BLOCK_M = 16, the first tile of a chunk must not touch keys past its last row.

    Context 10 + 40 new tokens. Tile 0 holds queries at positions 10..25; NaN in the K/V of positions >= 26
    must leave those 16 rows exact (a kernel that loaded them and only masked the scores would get
    0 * NaN = NaN from `p @ v`), while the later rows, which do see those keys, turn NaN.
    """
    monkeypatch.setattr(triton_prefill, "_MAX_BLOCK_M", 16)
    block_size, context, q_len = 8, 10, 40
    batch = make_batch([(context + q_len, q_len)], 2, 16, block_size, torch.float32, seed=9)
    expected = reference(batch)
    pos = torch.arange(context + 16, context + q_len)  # keys no query of tile 0 may see
    slots = batch["block_tables"][0, pos // block_size].long() * block_size + pos % block_size
    for cache in (batch["k_cache"], batch["v_cache"]):
        cache.view(-1, *cache.shape[2:])[slots.to(DEVICE)] = float("nan")
    out = run_prefill(batch)
    torch.testing.assert_close(out[:16], expected[:16], atol=1e-5, rtol=0)
    assert torch.isnan(out[16:]).any(dim=(1, 2)).all()  # the poison was really there


def test_prefill_strided_q_and_out_slice():
    """q as a view into a fused QKV tensor; out as a slice of a bigger buffer whose other rows stay untouched."""
    reqs = [(12, 12), (20, 6)]
    batch = make_batch(reqs, 2, 16, 8, torch.float32, seed=10)
    expected = reference(batch)
    N, H, D = batch["q"].shape
    qkv = torch.randn(N, 3, H, D, device=DEVICE)
    qkv[:, 0] = batch["q"]
    batch["q"] = qkv[:, 0]  # [N, H, D], token stride 3 * H * D
    big = torch.full((N + 3, H, D), 7.0, device=DEVICE)
    result = run_prefill(batch, out=big[1 : 1 + N])
    assert result.data_ptr() == big[1].data_ptr()
    torch.testing.assert_close(big[1 : 1 + N], expected, atol=1e-5, rtol=0)
    assert (big[0] == 7).all() and (big[1 + N :] == 7).all()


# ---------------------------------------------------------------------------------------------
# attention_triton: a whole mixed batch, decodes first
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, block_size, dtype",
    [(11, 4, torch.float32), (12, 16, torch.float32), (13, 8, torch.float16), (14, 32, torch.bfloat16)],
)
def test_attention_triton_mixed_batch_matches_reference(seed, block_size, dtype):
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 40), 1) for _ in range(rng.randint(1, 3))]
    reqs = decodes + random_reqs(rng, block_size, n=rng.randint(1, 3))
    batch = make_batch(reqs, 2, 16, block_size, dtype, seed=seed)
    expected = reference(batch)
    N, H, D = batch["q"].shape
    big = torch.full((N + 2, H, D), 7.0, dtype=dtype, device=DEVICE)
    out = attention_triton(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["query_start_loc"],
        batch["seq_lens"], len(decodes), batch["max_query_len"], batch["scale"], out=big[:N],
    )  # fmt: skip
    assert out.data_ptr() == big.data_ptr() and (big[N:] == 7).all()
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("reqs, num_decodes", [([(5, 1), (17, 1), (8, 1)], 3), ([(9, 9), (20, 4)], 0)])
def test_attention_triton_all_decodes_or_all_prefills(reqs, num_decodes):
    batch = make_batch(reqs, 2, 16, 8, torch.float32, seed=15)
    out = attention_triton(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["query_start_loc"],
        batch["seq_lens"], num_decodes, batch["max_query_len"], batch["scale"],
    )  # fmt: skip
    assert_close(out, reference(batch), torch.float32)


# ---------------------------------------------------------------------------------------------
# Bad arguments fail loudly
# ---------------------------------------------------------------------------------------------


def _args(D=16, block_size=8, dtype=torch.float32):
    batch = make_batch([(10, 10), (12, 3)], 2, D, block_size, dtype, seed=0)
    keys = ("q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "max_query_len", "scale")
    return {k: batch[k] for k in keys}


def _with(**changes):
    return {**_args(), **changes}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _args(D=8), "head_dim must be >= 16"),
        (lambda: _args(D=24), "head_dim must be a power of two"),
        (lambda: _args(block_size=12), "block_size must be a power of two"),
        (lambda: _with(seq_lens=torch.tensor([10.0, 12.0], device=DEVICE)), "seq_lens must be an integer tensor"),
        (lambda: _with(query_start_loc=torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)), "query_start_loc"),
        pytest.param(lambda: _with(max_query_len=5), "max_query_len 5 < the longest q_len", marks=HOST_ONLY),
        (lambda: _with(max_query_len=0), "max_query_len must be an int >= 1"),
        pytest.param(
            lambda: _with(seq_lens=torch.tensor([10, 2], dtype=torch.int32, device=DEVICE)),
            "seq_len >= q_len",
            marks=HOST_ONLY,
        ),
        pytest.param(
            lambda: _with(query_start_loc=torch.tensor([1, 11, 13], dtype=torch.int32, device=DEVICE)),
            "query_start_loc must run from 0",
            marks=HOST_ONLY,
        ),
        pytest.param(
            lambda: _with(block_tables=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)),
            "block_tables has too few columns",
            marks=HOST_ONLY,
        ),
    ],
)
def test_prefill_rejects_bad_arguments(make, match):
    with pytest.raises(AssertionError, match=match):
        prefill_attention_triton(**make())


def test_prefill_rejects_wrong_out_and_attention_triton_checks_the_split():
    args = _args()
    with pytest.raises(AssertionError, match="out must be"):
        prefill_attention_triton(**args, out=torch.empty(3, 2, 16, device=DEVICE))
    with pytest.raises(AssertionError, match="num_decodes must be in"):
        attention_triton(**args, num_decodes=3)
    if DEVICE == "cpu":  # a value check: done only where it costs no device sync
        with pytest.raises(AssertionError, match="must be decodes"):  # request 0 has q_len 10, not 1
            attention_triton(**args, num_decodes=1)
