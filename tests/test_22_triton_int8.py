"""Stage 22's W8A8 kernels in Triton (quantization/triton_int8.py) against the references of int8.py.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so the kernels run on CPU tensors in Triton's interpreter
(its int8 `tl.dot` is numpy's matmul with int32 sums) and the tests call the launchers directly: shapes stay tiny.
The int32 product must equal `int8_mm_reference` bit for bit, the quantization `scaled_int8_quant` bit for bit,
and the scaled output the reference epilogue to fp32 rounding (a GPU may fuse a multiply and the bias add into
one FMA). The `cuda` test runs an Int8Linear on a GPU through the compiled kernels against the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from roseinfer.model_executor.quantization import triton_int8  # noqa: E402
from roseinfer.model_executor.quantization.int8 import (  # noqa: E402
    int8_mm_reference,
    quantize_weight,
    scaled_int8_quant,
    scaled_mm_epilogue,
    w8a8_linear_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
ONE = torch.ones(1, 1, device=DEVICE)  # a scale the int32 output never reads
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # rtol: about one unit in the last place


def randn(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def weights(out: int, k: int, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    w_q, w_s = quantize_weight(randn(out, k, seed=seed).cpu() * 0.05)
    return w_q.to(DEVICE), w_s.to(DEVICE)


# ---- the quantization: bit-equal to scaled_int8_quant ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 7), (3, 64), (17, 1100)], ids=str)  # K = 1100: two tiles of 1024 columns
def test_dynamic_quant_is_bit_equal_to_the_reference(dtype, shape):
    x = randn(*shape, dtype=dtype) * 3
    x[0, : shape[1] // 2] = 0.0  # zeros, and a row of only zeros below: scale 1
    if shape[0] > 2:
        x[2] = 0.0
    got_q, got_s = triton_int8.int8_quant_triton(x)
    want_q, want_s = scaled_int8_quant(x)
    assert got_q.dtype == torch.int8 and got_s.shape == (shape[0], 1)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)


def test_quant_rounds_ties_to_even_as_torch_round():
    """x / s lands exactly on k + 0.5 for a row whose max is 127 (s = 1): torch.round sends ties to even."""
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -126.5, 3.25, 127.0], device=DEVICE)
    got_q, got_s = triton_int8.int8_quant_triton(ties[None, :])
    want_q, want_s = scaled_int8_quant(ties[None, :])
    assert got_s.item() == 1.0 and got_q.tolist() == want_q.tolist() == [[0, 2, 2, 0, -2, -2, 126, -126, 3, 127]]


def test_static_quant_divides_by_the_given_scale_and_clamps():
    x = randn(5, 40) * 10  # |x| / 0.03 far past 127 for most: clamped to ±127
    scale = torch.tensor([0.03], device=DEVICE)
    got_q, got_s = triton_int8.int8_quant_triton(x, scale)
    want_q, want_s = scaled_int8_quant(x, scale)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s) and got_s.shape == (1, 1)
    assert got_q.abs().max() == 127


# ---- the GEMM: the int32 part bit for bit, then the epilogue ---------------------------------------------------
SHAPES = [(1, 32, 48), (3, 100, 70), (17, 300, 130), (64, 64, 16)]  # (N, K, out): K % BLOCK_K != 0, ragged N, out


@pytest.mark.parametrize("n, k, out", SHAPES, ids=str)
def test_int32_product_is_bit_equal_to_the_reference(n, k, out):
    x_q, _ = scaled_int8_quant(randn(n, k))
    w_q, w_s = weights(out, k)
    got = triton_int8.scaled_mm_triton(x_q, w_q, ONE, w_s, None, torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, int8_mm_reference(x_q, w_q))


def test_int32_product_of_extreme_values_does_not_overflow():
    """Every product ±127 · ±127 over K = 1000: |sum| up to 16.1 million, exact in int32 (not in fp32's 24 bits
    for every sum, which is why the accumulator is an integer)."""
    x_q = torch.full((2, 1000), 127, dtype=torch.int8, device=DEVICE)
    x_q[1, ::3] = -127
    w_q = torch.full((20, 1000), -127, dtype=torch.int8, device=DEVICE)
    w_q[::2, 1::2] = 127
    got = triton_int8.scaled_mm_triton(x_q, w_q, ONE, ONE.new_ones(20), None, torch.int32)
    assert torch.equal(got, int8_mm_reference(x_q, w_q))


def test_many_tiles_in_every_dimension(monkeypatch):
    """Tiles of 16 x 16 x 32: 2 x 3 programs, 4 steps along K, each dimension ragged."""
    monkeypatch.setattr(triton_int8, "_tiles", lambda m: (16, 16, 32, 4))
    x_q, x_s = scaled_int8_quant(randn(19, 100))
    w_q, w_s = weights(40, 100)
    assert torch.equal(triton_int8.scaled_mm_triton(x_q, w_q, x_s, w_s, None, torch.int32), int8_mm_reference(x_q, w_q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("n, k, out", SHAPES[:3], ids=str)
def test_epilogue_equals_the_reference(n, k, out, static, dtype):
    x = randn(n, k, seed=2)
    x_q, x_s = scaled_int8_quant(x, torch.tensor([0.02], device=DEVICE) if static else None)  # [N, 1] or [1, 1]
    w_q, w_s = weights(out, k)
    bias = randn(out, seed=3, dtype=dtype)
    acc = int8_mm_reference(x_q, w_q)
    for b in (None, bias):
        got = triton_int8.scaled_mm_triton(x_q, w_q, x_s, w_s, b, dtype)
        want = scaled_mm_epilogue(acc, x_s, w_s, b, dtype)
        assert got.dtype == dtype and got.shape == (n, out)
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max().item())


def test_weight_read_through_a_transposed_view():
    """w8a8_linear hands the kernel weight_t.t(): a [K, out] tensor's transpose works, whatever its strides."""
    x_q, x_s = scaled_int8_quant(randn(3, 70))
    w_q, w_s = weights(24, 70)
    got = triton_int8.scaled_mm_triton(x_q, w_q.t().contiguous().t(), x_s, w_s, None, torch.int32)
    assert torch.equal(got, int8_mm_reference(x_q, w_q))


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_w8a8_linear_triton_equals_the_reference(static):
    x, bias = randn(2, 3, 96, seed=4), randn(40, seed=5)  # [B, T, K]: the leading dims are kept
    w_q, w_s = weights(40, 96)
    input_scale = torch.tensor([0.025], device=DEVICE) if static else None
    got = triton_int8.w8a8_linear_triton(x, w_q, w_s, input_scale, bias)
    want = w8a8_linear_reference(x, w_q, w_s, input_scale, bias)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_no_rows():
    w_q, w_s = weights(8, 16)
    assert triton_int8.w8a8_linear_triton(randn(0, 16), w_q, w_s).shape == (0, 8)


# ---- CUDA only: the layer through the compiled kernels ---------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 17, 200])  # 1: fewer rows than cuBLAS' int8 GEMM takes
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int8_linear_on_cuda_runs_the_triton_kernels_and_equals_the_reference(dtype, rows, static):
    from roseinfer.model_executor.quantization import int8_linear

    layer = int8_linear.Int8Linear(576, 960, bias=True, static_input=static)  # SmolLM2's qkv_proj
    w_q, w_s = quantize_weight(torch.randn(960, 576, generator=torch.Generator().manual_seed(0)) * 0.05)
    layer.weight.data, layer.weight_scale.data = w_q, w_s[:, None]
    layer.bias.data = torch.randn(960)
    if static:
        layer.input_scale.data = torch.tensor([0.02])
    layer = layer.to(device="cuda", dtype=dtype)
    layer.process_weights_after_loading()
    assert layer.weight_t.data_ptr() == layer.weight.data_ptr()  # a view: the kernel reads weight [out, K]
    x = torch.randn(rows, 576, device="cuda", dtype=dtype)
    x_q, _ = triton_int8.int8_quant_triton(x, layer.input_scale)
    assert torch.equal(x_q, scaled_int8_quant(x, layer.input_scale)[0])
    got = layer(x)
    layer.use_reference = True
    want = layer(x)
    assert got.dtype == dtype and int8_linear.triton_int8_importable()
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max().item())
