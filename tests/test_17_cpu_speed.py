"""Stage 17: linear layers through oneDNN with weights packed once, decode attention that reads the paged
cache in place (a C++ kernel), and the roofline script's arithmetic.

The packed path must be the same function as F.linear (to fp32 rounding), must give HF's greedy tokens,
and must be chosen only where it runs; the roofline's FLOP count must be GPT-2 small's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import core, hf_greedy, make_random_checkpoint

from roseinfer import LLM, SamplingParams
from roseinfer.attention import resolve_backend_name
from roseinfer.attention.cpu_paged import paged_decode_cpu
from roseinfer.attention.reference import paged_attention_reference
from roseinfer.model_executor.dense_linear import dense_supported
from roseinfer.model_executor.onednn_linear import (
    bucket_rows,
    pack_weight,
    packed_linear,
    record_calls,
    resolve_linear_backend,
    row_buckets,
    warm_up,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_f_linear(rows, bias):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96), torch.randn(160, 96) * 0.1
    b = torch.randn(160) if bias else None
    torch.testing.assert_close(packed_linear(x, pack_weight(w), b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_3d_and_strided_input_and_fuses_tanh_gelu():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 96), torch.randn(160, 96) * 0.1, torch.randn(160)
    packed = pack_weight(w)
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    strided = x[:, 2]  # [3, 96], rows 5 * 96 apart
    torch.testing.assert_close(packed_linear(strided, packed, b), F.linear(strided, w, b), rtol=1e-5, atol=1e-5)
    fused = packed_linear(x, packed, b, gelu_tanh=True)
    torch.testing.assert_close(fused, F.gelu(F.linear(x, w, b), approximate="tanh"), rtol=1e-5, atol=1e-5)


def test_onednn_sees_a_few_row_counts_whatever_the_steps(monkeypatch):
    """A server's steps have any row count from 1 to the token budget; oneDNN builds and keeps a primitive for each
    shape it sees, so the rows are padded to a few sizes (zeros), and the answer is the same."""
    ns = (1, 2, 16, 17, 33, 64, 65, 97, 129, 1025, 2047)
    assert [bucket_rows(n) for n in ns] == [1, 2, 16, 20, 40, 64, 80, 112, 160, 1280, 2048]
    assert all(n <= bucket_rows(n) < 1.25 * n for n in range(1, 4097))  # padding: under a quarter of the rows
    assert all(bucket_rows(b) == b for b in row_buckets(4096))  # a bucket is its own size
    assert len(row_buckets(2048)) == 44 and row_buckets(2048) == sorted({bucket_rows(n) for n in range(1, 2049)})
    seen, call = set(), torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.add(x.shape[0]) or call(x, *a))
    torch.manual_seed(0)
    w, b = torch.randn(48, 24) * 0.1, torch.randn(48)
    packed = pack_weight(w)
    for rows in range(1, 200):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert seen == set(row_buckets(199)) and len(seen) == 16 + 4 + 4 + 4 + 3  # ..., 128, 160, 192, 224


def test_record_calls_notes_each_kind_of_linear_once_and_warm_up_calls_it_at_every_bucket(monkeypatch):
    seen, call = [], torch.ops.mkldnn._linear_pointwise
    torch.manual_seed(0)
    w1, w2, b = torch.randn(48, 24), torch.randn(48, 24), torch.randn(48)
    p1, p2 = pack_weight(w1), pack_weight(w2)
    with record_calls() as calls:
        packed_linear(torch.randn(3, 24), p1, b)
        packed_linear(torch.randn(70, 24), p2, b)  # the same kind as the first: another weight, another row count
        packed_linear(torch.randn(5, 24), p1, b, gelu_tanh=True)
        packed_linear(torch.randn(5, 24), p1, None)
    packed_linear(torch.randn(5, 24), p1, None, gelu_tanh=True)  # after the block: not recorded
    f32 = torch.float32
    assert list(calls) == [(24, 48, f32, True, "none", (), ""), (24, 48, f32, True, "gelu", (), "tanh"),
                           (24, 48, f32, False, "none", (), "")]  # fmt: skip
    assert calls[(24, 48, f32, True, "none", (), "")][0] is p1
    assert torch.ops.mkldnn._linear_pointwise is call  # oneDNN's own entry point is back
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or call(x, *a))
    assert warm_up(calls, 100) == 3 * 27 and seen == row_buckets(100) * 3  # 1..16, 20..32, 40..64, 80, 96, 112


def test_packed_linear_in_bf16():
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    y = packed_linear(x, pack_weight(w), None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)


def test_the_backend_is_onednn_only_where_it_runs():
    for dtype in (torch.float32, torch.bfloat16):  # stage 20's own GEMM first, where this CPU runs it
        assert resolve_linear_backend("auto", CPU, dtype) == ("dense" if dense_supported(CPU, dtype) else "onednn")
    assert resolve_linear_backend("auto", CPU, torch.float16) == "aten"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "aten"
    assert resolve_linear_backend("aten", CPU, torch.float32) == "aten"
    with pytest.raises(ValueError, match="linear_backend='onednn' runs on a CPU"):
        resolve_linear_backend("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="linear_backend='onednn' runs on a CPU"):
        resolve_linear_backend("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="unknown linear_backend 'mkl'"):
        LLM(linear_backend="mkl")
    with pytest.raises(TypeError, match="linear_backend must be one of"):
        LLM(linear_backend=3)


def test_the_engine_packs_every_linear_layer_and_the_head():
    runner = core(LLM(device="cpu", dtype="float32")).model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(m.packed is not None for m in layers)
    assert runner.model.head_packed is not None
    plain = LLM(device="cpu", dtype="float32", linear_backend="aten")
    assert all(getattr(m, "packed", None) is None for m in core(plain.llm_engine).model_runner.model.modules())


@pytest.mark.parametrize("tie", [True, False])
def test_greedy_with_packed_weights_equals_hf_and_the_aten_path(tmp_path, tie):
    from transformers import GPT2LMHeadModel

    path = make_random_checkpoint(tmp_path / "m", seed=3, tie_word_embeddings=tie, n_embd=96, n_head=4, n_layer=2)
    hf = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 2], [9] * 11, list(range(40, 61))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = {}
    for backend in ("dense", "onednn", "aten") if dense_supported(CPU, torch.float32) else ("onednn", "aten"):
        outs = LLM(str(path), device="cpu", dtype="float32", linear_backend=backend).generate(
            prompts, params, use_tqdm=False
        )
        ids[backend] = [o.token_ids for o in outs]
    assert ids["onednn"] == ids["aten"] == ids.get("dense", ids["aten"])
    for prompt, got in zip(prompts, ids["onednn"], strict=True):
        hf.generation_config.eos_token_id = None  # ignore_eos: HF must not stop early either
        assert got == hf_greedy(hf, prompt, 24)


def test_roofline_counts_gpt2_small_flops():
    """step_cost's GEMM FLOPs for one row are 2 x the linear weights of GPT-2 small, LM head included."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.engine import roofline

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config())
    weights = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("weight") and p.dim() == 2 and ".h." in n)
    weights += hf.lm_head.weight.numel()
    flops, nbytes = roofline.step_cost(1, 0)
    assert flops == 2 * weights
    assert nbytes == 4 * weights  # fp32 weights, read once; no context, no K/V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [(4, 64, 16), (3, 80, 8), (1, 32, 1)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_the_cpu_decode_kernel_equals_the_reference(dtype, heads, head_dim, block_size, index_dtype):
    """Blocks in random order, lengths from 1 token to a full table, one row that ends on a block boundary."""
    torch.manual_seed(heads * head_dim + block_size)
    num_blocks, width = 64, 9
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, head_dim).to(dtype)
    q = torch.randn(6, heads, head_dim).to(dtype)
    lens = torch.tensor([1, 2 * block_size, width * block_size, 5, 3 * block_size + 1, block_size + 2])
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(6)])
    out = paged_decode_cpu(q, k_cache, v_cache, tables.to(index_dtype), lens.to(index_dtype), head_dim**-0.5)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_the_cpu_backend_is_the_default_on_a_cpu_and_only_there():
    assert resolve_backend_name("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on a CPU"):
        resolve_backend_name("cpu", "cuda")


def test_the_cpu_backend_reads_no_gathered_copy_for_decodes(monkeypatch):
    """The decode rows never reach index_select (no block gathers) and the tokens equal the sdpa backend's."""
    prompts = [[5, 6, 7], list(range(10, 61)), [9] * 30, list(range(100, 120))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids, calls, real = {}, [], torch.index_select  # sdpa's decode gathers call torch.index_select(..., out=)
    monkeypatch.setattr(torch, "index_select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for backend in ("sdpa", "cpu"):
        llm = LLM(device="cpu", dtype="float32", attention_backend=backend, enable_prefix_caching=False)
        calls.clear()
        ids[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (len(calls) == 0) == (backend == "cpu")
    assert ids["cpu"] == ids["sdpa"]
