"""copy_blocks (copy-on-write's block copy): the reference and the Triton kernel against a plain loop over pairs.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so the kernel runs on CPU in Triton's interpreter:
shapes stay tiny. A copy must be exact, so pools are compared bit for bit (viewed as integers of the same
width), and they hold NaN and -0.0, which a float comparison would wave through or trip over.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from roseinfer.attention import AttentionBackend, get_backend, triton_copy  # noqa: E402
from roseinfer.attention.reference import copy_blocks_reference  # noqa: E402
from roseinfer.attention.triton_copy import copy_blocks_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
IMPLS = {"reference": copy_blocks_reference, "triton": copy_blocks_triton}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_pools(layers, num_blocks, block_size, H, D, dtype, seed=0):
    """`layers` (K, V) pools of random values, a different pattern in every pool, with NaN and -0.0 in each block."""
    g = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(layers):
        kv = []
        for _ in range(2):
            t = torch.randn(num_blocks, block_size, H, D, generator=g)  # [num_blocks, block_size, H, D]
            t[:, 0, 0, 0] = float("nan")
            t[:, -1, -1, -1] = -0.0
            kv.append(t.to(dtype).to(DEVICE))
        pools.append(tuple(kv))
    return pools


def make_mapping(num_blocks, P, seed=0, dtype=torch.int64):
    """P pairs, in scrambled order: P fresh dst blocks, and srcs among the other blocks (a src may repeat)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    dst, others = perm[:P], perm[P:]
    src = others[torch.randint(len(others), (P,), generator=g)]  # repeats allowed: one block copied twice
    return torch.stack([src, dst], dim=1).to(dtype)  # [P, 2]


def loop_copy(pools, mapping):
    """The oracle: a copy of the pools, then one block at a time, pair after pair, layer after layer."""
    out = [(k.clone(), v.clone()) for k, v in pools]
    for k, v in out:
        for src, dst in mapping.tolist():
            k[dst] = k[src]
            v[dst] = v[src]
    return out


def bits(t):
    """The tensor's bits as integers: equal bits are equal tensors, NaN payloads and -0.0 included."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(pools, expected):
    assert len(pools) == len(expected)
    for (k, v), (k_exp, v_exp) in zip(pools, expected, strict=True):
        assert k.dtype == k_exp.dtype and torch.equal(bits(k), bits(k_exp))
        assert v.dtype == v_exp.dtype and torch.equal(bits(v), bits(v_exp))


# ---------------------------------------------------------------------------------------------
# Both implementations against the loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("D", [16, 32])
def test_copy_blocks_matches_loop(impl, dtype, layers, block_size, D):
    num_blocks, H, P = 10, 3, 4  # H = 3: block_size * H * D is not a power of two, the last tile is masked
    pools = make_pools(layers, num_blocks, block_size, H, D, dtype, seed=block_size + D)
    before = [(k.clone(), v.clone()) for k, v in pools]
    mapping = make_mapping(num_blocks, P, seed=layers)
    expected = loop_copy(pools, mapping)

    IMPLS[impl](pools, mapping)
    assert_same_bits(pools, expected)
    untouched = sorted(set(range(num_blocks)) - set(mapping[:, 1].tolist()))  # srcs included
    for (k, v), (k0, v0) in zip(pools, before, strict=True):
        assert torch.equal(bits(k[untouched]), bits(k0[untouched])) and torch.equal(
            bits(v[untouched]), bits(v0[untouched])
        )


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("P", [0, 1, 12])
def test_pair_counts(impl, P):
    """No pairs is a no-op; one pair; many pairs (half the pool, scrambled, repeated srcs)."""
    num_blocks = 24
    pools = make_pools(2, num_blocks, 8, 3, 16, torch.float16, seed=P)
    mapping = make_mapping(num_blocks, P, seed=P) if P else torch.empty(0, 2, dtype=torch.int64)
    expected = loop_copy(pools, mapping)
    IMPLS[impl](pools, mapping)
    assert_same_bits(pools, expected)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_one_src_copied_to_several_dsts_with_int32_ids(impl):
    """A fork into three sequences copies one block twice; the pairs may come as int32."""
    pools = make_pools(2, 8, 4, 3, 16, torch.bfloat16, seed=3)
    mapping = torch.tensor([[5, 0], [2, 7], [5, 3]], dtype=torch.int32)
    expected = loop_copy(pools, mapping)
    IMPLS[impl](pools, mapping)
    assert_same_bits(pools, expected)
    for k, v in pools:
        assert torch.equal(bits(k[0]), bits(k[5])) and torch.equal(bits(v[3]), bits(v[5]))


@pytest.mark.parametrize("max_tile", [64, 128])
def test_triton_many_tiles_per_block(monkeypatch, max_tile):
    """A block of 4 * 3 * 16 = 192 elements split into 3 full tiles of 64, or 2 tiles of 128 (the last half masked)."""
    monkeypatch.setattr(triton_copy, "_MAX_TILE", max_tile)
    pools = make_pools(3, 9, 4, 3, 16, torch.float32, seed=max_tile)
    mapping = make_mapping(9, 4, seed=1)
    expected = loop_copy(pools, mapping)
    copy_blocks_triton(pools, mapping)
    assert_same_bits(pools, expected)


def test_triton_new_pools_get_a_new_pointer_table():
    """The kernel reaches the pools by the addresses in a cached table: new pools must not reuse stale ones."""
    a = make_pools(2, 6, 4, 3, 16, torch.float16, seed=1)
    b = make_pools(3, 6, 4, 3, 16, torch.float16, seed=2)
    for pools, mapping in [(a, [[0, 1]]), (b, [[2, 3]]), (a, [[4, 5]])]:
        mapping = torch.tensor(mapping)
        expected = loop_copy(pools, mapping)
        copy_blocks_triton(pools, mapping)
        assert_same_bits(pools, expected)


# ---------------------------------------------------------------------------------------------
# Backend wiring
# ---------------------------------------------------------------------------------------------


def test_backends_copy_blocks():
    assert get_backend("torch", DEVICE).copy_blocks is copy_blocks_reference
    assert get_backend("sdpa", "cpu").copy_blocks is copy_blocks_reference
    assert get_backend("triton", DEVICE).copy_blocks is copy_blocks_triton
    assert AttentionBackend("mine", lambda *a: None, lambda *a: None).copy_blocks is copy_blocks_reference  # default


# ---------------------------------------------------------------------------------------------
# Bad arguments fail loudly, and leave the pools alone
# ---------------------------------------------------------------------------------------------


def _pools(**overrides):
    kw = dict(layers=2, num_blocks=6, block_size=4, H=3, D=16, dtype=torch.float32)
    kw.update(overrides)
    return make_pools(**kw)


BAD_MAPPINGS = [
    (torch.tensor([1, 2]), r"\[P, 2\]"),
    (torch.tensor([[1, 2, 3]]), r"\[P, 2\]"),
    ([[1, 2]], r"\[P, 2\] tensor.*got list"),
    (torch.tensor([[1.0, 2.0]]), "integer block ids.*float32"),
    (torch.tensor([[True, False]]), "integer block ids.*bool"),
    (torch.tensor([[0, 1], [2, 6]]), r"pair 1 \[2, 6\] names a block outside 0..5"),
    (torch.tensor([[-1, 3]]), r"pair 0 \[-1, 3\] names a block outside"),
    (torch.tensor([[0, 3], [1, 3]]), "two pairs copy into the same dst block"),
    (torch.tensor([[0, 1], [1, 2]]), "block 1 is both a dst and a src"),  # a chain: order would matter
    (torch.tensor([[4, 4]]), "block 4 is both a dst and a src"),
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("mapping, match", BAD_MAPPINGS)
def test_bad_block_mapping_raises(impl, mapping, match):
    pools = _pools()
    before = [(k.clone(), v.clone()) for k, v in pools]
    with pytest.raises(ValueError, match=match):
        IMPLS[impl](pools, mapping)
    assert_same_bits(pools, before)


def _mismatched_layer():
    pools = _pools()
    pools[1] = (pools[1][0], _pools(layers=1, num_blocks=7)[0][1])
    return pools


def _mismatched_dtype():
    pools = _pools()
    pools[0] = (pools[0][0], pools[0][1].half())
    return pools


BAD_POOLS = [
    (lambda: [], "kv_caches is empty"),
    (lambda: [(torch.zeros(6, 4, 48), torch.zeros(6, 4, 48))], r"\[num_blocks, block_size, H, D\]"),
    (_mismatched_layer, r"layer 1's v_cache is \(7, 4, 3, 16\).*every pool must match"),
    (_mismatched_dtype, r"layer 0's v_cache is .* torch.float16"),
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("make, match", BAD_POOLS)
def test_bad_pools_raise(impl, make, match):
    with pytest.raises(ValueError, match=match):
        IMPLS[impl](make(), torch.tensor([[0, 1]]))


def _non_contiguous():
    k = torch.zeros(6, 3, 4, 16, device=DEVICE).transpose(1, 2)  # [6, 4, 3, 16], heads outermost in memory
    return [(k, k.contiguous())]


def _misaligned():
    flat = torch.zeros(6 * 4 * 3 * 16 + 1, device=DEVICE)
    return [(flat[1:].view(6, 4, 3, 16), flat[:-1].view(6, 4, 3, 16))]  # the K pool starts 4 bytes in


@pytest.mark.parametrize(
    "make, match",
    [
        (_non_contiguous, "layer 0's k_cache is not contiguous"),
        (_misaligned, "layer 0's k_cache does not start on a 16-byte boundary"),
        (lambda: _pools(dtype=torch.float64), "float32, float16, bfloat16 or fp8, got torch.float64"),
    ],
)
def test_triton_rejects_pools_it_cannot_copy(make, match):
    """What only the kernel needs: it reaches each pool by raw address, as contiguous 16-byte-aligned blocks."""
    with pytest.raises(ValueError, match=match):
        copy_blocks_triton(make(), torch.tensor([[0, 1]]))
