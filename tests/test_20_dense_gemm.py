"""Stage 20: the project's own float GEMM (csrc/dense_gemm.cpp, model_executor/dense_linear.py).

It is F.linear over a weight packed once: equal to it to fp32 rounding in fp32, and in bf16 to the output's own
rounding (the sums are fp32 in another order). Every row count and shape the tiles do not divide evenly (rows not
a multiple of 6, outputs not of 64, an odd number of inputs in bf16), a bias or none, 3-d input; the engine picks it
where it runs, and greedy output with it equals transformers' (test_17_cpu_speed.py) and the other backends'.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import core

from roseinfer import LLM, SamplingParams
from roseinfer.model_executor.dense_linear import DenseWeight, dense_linear, dense_supported, pack_dense_weight
from roseinfer.model_executor.onednn_linear import pack_weight, packed_linear, resolve_linear_backend

CPU = torch.device("cpu")
needs_fp32 = pytest.mark.skipif(not dense_supported(CPU, torch.float32), reason="no AVX-512 or no C++ ops here")
needs_bf16 = pytest.mark.skipif(not dense_supported(CPU, torch.bfloat16), reason="no AVX512-BF16 or no C++ ops here")


def test_the_packing_puts_64_outputs_by_e_inputs_in_a_row():
    w = torch.arange(70 * 5, dtype=torch.float32).reshape(70, 5)
    packed = pack_dense_weight(w)
    assert packed.out_features == 70 and packed.panels.shape == (2, 5, 64, 1)
    assert packed.panels[1, 3, 5, 0] == w[64 + 5, 3] and packed.panels[1, 0, 6:].abs().sum() == 0  # zero padding
    wb = w.to(torch.bfloat16)
    panels = pack_dense_weight(wb).panels  # [2, 3, 64, 2]: pairs of inputs, the last one padded
    assert panels.shape == (2, 3, 64, 2) and panels[0, 1, 7, 1] == wb[7, 3] and panels[0, 2, 7, 1] == 0


@needs_fp32
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 40, 200])
@pytest.mark.parametrize(("out", "k"), [(7, 5), (64, 64), (130, 577), (960, 576)])
def test_fp32_is_f_linear(rows, out, k):
    g = torch.Generator().manual_seed(rows * 1000 + out)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(out, k, generator=g) * 0.1, torch.randn(out, generator=g)
    for bias in (b, None):
        got = dense_linear(x, pack_dense_weight(w), bias)
        assert got.shape == (rows, out) and got.dtype == torch.float32
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 6, 7, 33])
@pytest.mark.parametrize(("out", "k"), [(7, 5), (130, 577), (576, 1536)])
def test_bf16_is_the_fp32_product_rounded_once(rows, out, k):
    """The fp32 sums of bf16 products, rounded to bf16 at the end: within one bf16 step of the exact product
    rounded (the order of the fp32 sums may tip a rounding)."""
    g = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(out, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16)
    got = dense_linear(x, pack_dense_weight(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    exact = F.linear(x.double(), w.double(), b.double())
    step = exact.abs().clamp_min(1e-3) * 2**-7  # one bf16 step at that magnitude (8 bits of mantissa)
    assert ((got.double() - exact).abs() <= step).all()
    onednn = F.linear(x, w, b)  # PyTorch's own bf16 linear is no closer to the exact product
    assert (got.double() - exact).abs().mean() <= 1.5 * (onednn.double() - exact).abs().mean() + 1e-6


@needs_fp32
def test_packed_linear_takes_a_dense_weight_3d_input_and_gelu():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 96, generator=g), torch.randn(160, 96, generator=g) * 0.1, torch.randn(160, generator=g)
    packed = pack_weight(w, "dense")
    assert isinstance(packed, DenseWeight)
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    strided = x[:, 2]  # [3, 96], rows 5 * 96 apart
    torch.testing.assert_close(packed_linear(strided, packed, b), F.linear(strided, w, b), rtol=1e-5, atol=1e-5)
    gelu = F.gelu(F.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(packed_linear(x, packed, b, gelu_tanh=True), gelu, rtol=1e-5, atol=1e-5)


@needs_fp32
def test_the_op_names_what_is_wrong():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    packed, out = pack_dense_weight(w), torch.empty(4, 16)
    with pytest.raises(RuntimeError, match="packed for 8 inputs, x has 9"):
        torch.ops.roseinfer.dense_gemm(out, torch.randn(4, 9), packed.panels, None)
    with pytest.raises(RuntimeError, match="no kernel for Double"):
        torch.ops.roseinfer.dense_gemm(out.double(), x.double(), packed.panels.double(), None)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        torch.ops.roseinfer.dense_gemm(out, x, packed.panels.to(torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.roseinfer.dense_gemm(out, x, packed.panels, torch.randn(15))
    with pytest.raises(RuntimeError, match="packed for 64 outputs, out has 65"):
        torch.ops.roseinfer.dense_gemm(torch.empty(4, 65), x, packed.panels, None)


@needs_fp32
def test_the_engine_picks_it_and_packs_every_layer_with_it():
    assert resolve_linear_backend("auto", CPU, torch.float32) == "dense"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "aten"
    with pytest.raises(ValueError, match="linear_backend='dense' runs on a CPU"):
        resolve_linear_backend("dense", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend='dense' runs on a CPU"):
        resolve_linear_backend("dense", CPU, torch.float16)
    runner = core(LLM(device="cpu", dtype="float32")).model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m.packed, DenseWeight) for m in layers)
    assert isinstance(runner.model.head_packed, DenseWeight)


@needs_bf16
def test_bf16_engine_output_agrees_with_onednn():
    """The bundled model in bf16, greedy, through both GEMMs: bf16 rounding may tip a token late in a sequence, so
    the check is the share of identical tokens, not equality."""
    prompts = [[5, 17, 300, 2], [9] * 11, list(range(40, 61))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = {}
    for backend in ("dense", "onednn"):
        outs = LLM(device="cpu", dtype="bfloat16", linear_backend=backend).generate(prompts, params, use_tqdm=False)
        ids[backend] = [t for o in outs for t in o.token_ids]
    same = sum(a == b for a, b in zip(ids["dense"], ids["onednn"], strict=True)) / len(ids["dense"])
    assert ids["dense"][:3] == ids["onednn"][:3] and same >= 0.75, same


@needs_fp32
def test_the_benchmark_runs_and_records_both_gemms(tmp_path, monkeypatch):
    from benchmarks.engine import bench_dense_gemm as bench

    monkeypatch.setattr(bench, "LAYERS", 2)
    monkeypatch.setattr(bench, "HEAD", (100, 576))
    out = tmp_path / "dense.json"
    args = ["--json", str(out), "--threads", "1", "--dtypes", "float32", "--rows", "3", "--repeat", "1"]
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["cold"], r["threads"]) for r in rows] == [(3, True, 1), (3, False, 1)]
    assert all(r["onednn_gflops"] > 0 and r["dense_gflops"] > 0 for r in rows)
