"""The Triton kernels of the fused ops (model_executor/triton_ops.py) against each op's `forward_native`.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so the kernels run on CPU tensors in Triton's interpreter
and the tests call the launchers directly (`forward` picks `forward_cuda` only for CUDA tensors): shapes stay tiny.
fp32 must match the reference to rounding; fp16 and bf16 to a couple of units in the last place, since the kernels
round once where PyTorch rounds after every op (and the interpreter rounds to bf16 by truncation).
The `cuda` tests run a small random Llama on a GPU with the kernels and without them.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from roseinfer.model_executor import triton_ops  # noqa: E402
from roseinfer.model_executor.activations import SiluAndMul  # noqa: E402
from roseinfer.model_executor.custom_op import set_custom_op_impl  # noqa: E402
from roseinfer.model_executor.layernorm import RMSNorm  # noqa: E402
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
DEVICE = "cuda" if not INTERPRET and torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=TOL[want.dtype], rtol=TOL[want.dtype])


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def make_norm(C: int, dtype) -> RMSNorm:
    norm = RMSNorm(C, eps=1e-6)
    norm.weight.data = randn(C, seed=9).float().cpu()  # not ones: a wrong column of the weight would show
    return norm.to(device=DEVICE, dtype=dtype)


# ---- RMSNorm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 64), (1, 1)], ids=str)  # odd width, [B, T, C], one element
def test_rms_norm_equals_native(dtype, shape):
    norm = make_norm(shape[-1], dtype)
    x = randn(*shape, dtype=dtype)
    close(triton_ops.rms_norm(x, norm.weight, norm.eps), norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 64)], ids=str)
def test_rms_norm_with_residual_equals_native_and_writes_in_place(dtype, shape):
    norm = make_norm(shape[-1], dtype)
    x, residual = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    want_out, want_residual = norm.forward_native(x.clone(), residual.clone())
    out, new_residual = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    close(out, want_out)
    close(new_residual, want_residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()  # vLLM's in place


def test_rms_norm_with_a_wider_weight_dtype_returns_that_dtype_as_the_reference_does():
    norm = make_norm(37, torch.float32)  # fp32 weight, fp16 rows: weight * h.to(fp16) is fp32
    x, residual = randn(3, 37, dtype=torch.float16, seed=1), randn(3, 37, dtype=torch.float16, seed=2)
    want_out, want_residual = norm.forward_native(x.clone(), residual.clone())
    out, new_residual = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)  # both fp32
    close(new_residual, want_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_over_the_heads_of_strided_q_views_of_qkv(dtype):
    """Qwen3's q_norm: q [N, H, D] and q [B, T, H, D] are views into the fused qkv output, rows never contiguous."""
    H, Hkv, D = 4, 2, 16
    norm = make_norm(D, dtype)
    qkv = randn(6, (H + 2 * Hkv) * D, dtype=dtype)  # [N, (H + 2 Hkv) D]
    for q in (qkv[:, : H * D].view(6, H, D), qkv.view(2, 3, -1)[..., : H * D].view(2, 3, H, D)):
        before = qkv.clone()
        close(triton_ops.rms_norm(q, norm.weight, norm.eps), norm.forward_native(q))
        assert torch.equal(qkv, before)  # without a residual nothing is written in place


def test_rms_norm_with_a_contiguous_x_and_a_strided_residual_walks_both_alike():
    norm = make_norm(16, torch.float32)
    x, wide = randn(6, 4, 16, seed=1), randn(6, 8 * 16, seed=2)
    residual = wide[:, : 4 * 16].view(6, 4, 16)  # rows of a token 16 apart, tokens 128 apart
    want_out, want_residual = norm.forward_native(x.clone(), residual.clone())
    out, new_residual = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    close(out, want_out)
    close(residual, want_residual)  # written in place, into `wide`
    assert new_residual.data_ptr() == residual.data_ptr()


def test_rms_norm_of_no_rows():
    norm = make_norm(8, torch.float32)
    x = randn(0, 8)
    out, residual = triton_ops.rms_norm(x, norm.weight, norm.eps, x.clone())
    assert out.shape == residual.shape == (0, 8)


# ---- rotary embedding -----------------------------------------------------------------------------
def qkv_views(N: int, H: int, Hkv: int, D: int, dtype):
    """The fused qkv output [N, (H + 2 Hkv) D] and q [N, H, D], k [N, Hkv, D] as views into it (as in llama.py)."""
    qkv = randn(N, (H + 2 * Hkv) * D, dtype=dtype, seed=3)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return qkv, q.view(N, H, D), k.view(N, Hkv, D)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 1, 12)], ids=["gqa", "odd-heads-d12"])  # D/2 = 6: masked
def test_rotary_of_strided_q_and_k_equals_native_in_place(is_neox, dtype, heads):
    H, Hkv, D = heads
    N = 5
    qkv, q, k = qkv_views(N, H, Hkv, D, dtype)
    cos, sin = RotaryEmbedding(D, 10000.0).to(DEVICE)(torch.tensor([0, 3, 7, 100, 2047], device=DEVICE), dtype)
    op = ApplyRotary(is_neox)
    want_q, want_k = op.forward_native(q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (H + Hkv) * D :].clone()
    got_q, got_k = triton_ops.rotary(q, k, cos, sin, is_neox)
    close(got_q, want_q)
    close(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    close(q, want_q)  # the views into qkv hold the rotated values ...
    assert torch.equal(qkv[:, (H + Hkv) * D :], v_before)  # ... and v, beside them, is untouched


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_of_a_dense_batch_broadcasts_cos_over_it(is_neox):
    """The dense forward: q [B, T, H, D] with cos, sin [T, 1, D] shared by the B sequences."""
    B, T, H, Hkv, D = 2, 3, 4, 2, 8
    qkv = randn(B, T, (H + 2 * Hkv) * D)
    q = qkv[..., : H * D].view(B, T, H, D)
    k = qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D)
    cos, sin = RotaryEmbedding(D, 10000.0).to(DEVICE)(torch.arange(T, device=DEVICE) + 5, torch.float32)
    want_q, want_k = ApplyRotary(is_neox).forward_native(q.clone(), k.clone(), cos, sin)
    got_q, got_k = triton_ops.rotary(q, k, cos, sin, is_neox)
    close(got_q, want_q)
    close(got_k, want_k)


# ---- SiLU-and-mul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 45), (2, 2, 2 * 1100), (4, 2)], ids=str)  # odd I; I > one tile; I = 1
def test_silu_and_mul_equals_native(dtype, shape):
    x = randn(*shape, dtype=dtype) * 4  # the tails of the gate: silu saturates at both ends
    close(triton_ops.silu_and_mul(x), SiluAndMul().forward_native(x))


def test_silu_and_mul_of_a_strided_input_and_of_no_rows():
    x = randn(3, 4 * 10)[:, : 2 * 10]  # rows 40 apart: [gate | up] of width 20, not contiguous
    close(triton_ops.silu_and_mul(x), SiluAndMul().forward_native(x))
    assert triton_ops.silu_and_mul(randn(0, 6)).shape == (0, 3)


# ---- dispatch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [RMSNorm(8, 1e-6), ApplyRotary(), SiluAndMul()], ids=lambda o: type(o).__name__)
def test_auto_picks_the_triton_kernel_for_cuda_tensors_only(op):
    assert op.has_cuda_kernel()  # triton is importable here
    assert op.choose(torch.device("cuda")) == op.forward_cuda
    assert op.choose(torch.device("cpu")) != op.forward_cuda
    op.set_impl("native")
    assert op.choose(torch.device("cuda")) == op.forward_native


# ---- CUDA only: a small Llama with the kernels and without them --------------------------------------
LLAMAS = {  # name -> (architecture, config overrides)
    "llama-gqa": ("LlamaForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=32)),  # RMSNorm over q and k heads (strided views)
}


def ops_running(model) -> set[str]:
    """The names of the implementations the model's CustomOps picked on their last first call."""
    return {m._forward.__name__ for m in model.modules() if getattr(m, "_forward", None) is not None}


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """The first forward's logits, and `steps` greedy tokens by re-running the dense forward (no cache)."""
    first = model(ids)
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return first, ids[:, -steps:].tolist()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name, dtype",
    [("llama-gqa", torch.float32), ("llama-gqa", torch.float16), ("llama-gqa", torch.bfloat16),
     ("qwen3-qk-norm", torch.float32)],
)  # fmt: skip
def test_llama_on_cuda_with_the_triton_ops_gives_the_native_logits(tmp_path, name, dtype):
    from conftest import make_llama_checkpoint

    from roseinfer.model_executor.loader import load_model, read_model_config

    arch, overrides = LLAMAS[name]
    make_llama_checkpoint(tmp_path, arch, **overrides)
    model = load_model(tmp_path, read_model_config(tmp_path), torch.device("cuda"), dtype)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    set_custom_op_impl(model, "native")
    want_logits, want_tokens = greedy(model, ids, 8)
    assert ops_running(model) == {"forward_native"}
    set_custom_op_impl(model, "auto")
    got_logits, got_tokens = greedy(model, ids, 8)
    assert ops_running(model) == {"forward_cuda"}  # every RMSNorm, ApplyRotary and SiluAndMul ran its kernel
    err = (got_logits.float() - want_logits.float()).abs().max().item()
    scale = want_logits.float().abs().max().item()
    assert err <= (1e-4 if dtype == torch.float32 else 3e-2) * scale, (err, scale)
    if dtype == torch.float32:
        assert got_tokens == want_tokens


@pytest.mark.cuda
def test_engine_on_cuda_with_the_triton_ops_equals_transformers(tmp_path):
    """The paged path: q, k rotated in place inside qkv, CUDA graphs captured with the kernels in them."""
    from conftest import core, make_llama_checkpoint

    from roseinfer import LLM, SamplingParams

    hf = make_llama_checkpoint(tmp_path, "LlamaForCausalLM")
    prompts = [[5, 17, 200, 33, 9], [42], list(range(60, 97))]
    want = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    with LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=4) as llm:  # graphs for 1, 2, 4
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ops_running(core(llm.llm_engine).model_runner.model) == {"forward_cuda"}
    assert got == want
