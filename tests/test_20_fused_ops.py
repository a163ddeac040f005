"""Stage 20: the Llama layer's small ops as fused C++ kernels (roseinfer/csrc/layernorm.cpp, activation.cpp,
rotary.cpp), each checked against its PyTorch reference (the CustomOp's forward_native), then the whole model
with custom_ops "auto" against "native", and the setting itself."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import make_llama_checkpoint

from roseinfer import LLM, SamplingParams, custom_ops
from roseinfer.attention.fp8_kv import write_slots
from roseinfer.attention.sdpa import write_kv_flat
from roseinfer.config import EngineArgs
from roseinfer.model_executor.activations import SiluAndMul
from roseinfer.model_executor.custom_op import set_custom_op_impl
from roseinfer.model_executor.layernorm import RMSNorm
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding

needs_ops = pytest.mark.skipif(not custom_ops.available(), reason="the C++ extension cannot be built here")
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),  # ~1 ulp
       torch.float16: dict(atol=4e-3, rtol=4e-3)}  # fmt: skip
# RoPE's reference rounds x·cos and x'·sin to bf16 before their sum; the kernel rounds once. Where the two nearly
# cancel, the difference is an ulp of the products (inputs up to ~10 here: 1/16), not of the small result.
ROPE_TOL = {**TOL, torch.bfloat16: dict(atol=7e-2, rtol=2e-2), torch.float16: dict(atol=1e-2, rtol=4e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [0, 1, 7, 33]


def rand(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def make_norm(C: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(C, 1e-6).to(dtype)
    norm.weight.data = rand(C, dtype=dtype)
    return norm


def qkv_views(N: int, H: int, Hkv: int, D: int, dtype: torch.dtype):
    """q [N, H, D], k, v [N, Hkv, D]: views into one [N, (H + 2 Hkv) D] tensor, as the fused qkv_proj gives."""
    qkv = rand(N, (H + 2 * Hkv) * D, dtype=dtype, scale=3.0)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(N, H, D), k.view(N, Hkv, D), v.view(N, Hkv, D)


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("C", [576, 100, 17])  # a multiple of 16, and two that leave a tail
def test_rms_norm_and_the_fused_residual_add_equal_the_reference(dtype, N, C):
    torch.manual_seed(N * 1000 + C)
    norm = make_norm(C, dtype)
    x, residual = rand(N, C, dtype=dtype, scale=4.0), rand(N, C, dtype=dtype, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), **TOL[dtype])
    assert torch.equal(x, x0)  # plain RMSNorm writes a new tensor
    want_out, want_res = norm.forward_native(x, residual)
    out, res = norm.forward_cpu(x, residual)
    assert out is x and res is residual  # in place: the sum into residual, the normalised rows into x
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # the sum is one rounding in the dtype, as torch's
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    assert not torch.equal(residual, r0) or N == 0


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 5])
def test_rms_norm_reads_head_views_of_the_qkv_output_where_they_lie(dtype, N):
    """Qwen3's q/k norm: RMSNorm over D for every head of a strided [N, H, D] view (row stride (H + 2Hkv)·D)."""
    torch.manual_seed(N)
    q, k, _ = qkv_views(N, 4, 2, 32, dtype)
    norm = make_norm(32, dtype)
    for x in (q, k):
        assert not x.is_contiguous() or N == 1
        out = norm.forward_cpu(x)
        assert out.shape == x.shape
        torch.testing.assert_close(out, norm.forward_native(x), **TOL[dtype])
    x3 = rand(2, 3, 32, dtype=dtype)  # the dense path's [B, T, C]
    torch.testing.assert_close(norm.forward_cpu(x3), norm.forward_native(x3), **TOL[dtype])


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("inter", [1536, 100, 5])
def test_silu_and_mul_equals_the_reference(dtype, N, inter):
    torch.manual_seed(N + inter)
    act = SiluAndMul()
    x = rand(N, 2 * inter, dtype=dtype, scale=4.0)
    x[:, :3] = torch.tensor([-100.0, 100.0, 0.0], dtype=dtype)[: x.shape[1]] if N else x[:, :3]  # exp's far ends
    torch.testing.assert_close(act.forward_cpu(x), act.forward_native(x), **TOL[dtype])
    x3 = rand(2, 3, 2 * inter, dtype=dtype)  # [B, T, 2I]
    torch.testing.assert_close(act.forward_cpu(x3), act.forward_native(x3), **TOL[dtype])
    strided = rand(4, 4 * inter, dtype=dtype)[:, : 2 * inter]  # rows further apart than their width
    torch.testing.assert_close(act.forward_cpu(strided), act.forward_native(strided), **TOL[dtype])


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("D", [64, 6, 128])
def test_rotary_turns_q_and_k_in_place_like_the_reference(dtype, is_neox, N, D):
    torch.manual_seed(N + D)
    rope = ApplyRotary(is_neox)
    q, k, _ = qkv_views(N, 9, 3, D, dtype)
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.randint(0, 5000, (N,)), dtype)  # [N, 1, D]
    want_q, want_k = rope.forward_native(q, k, cos, sin)
    got_q, got_k = rope.forward_cpu(q, k, cos, sin)
    assert got_q is q and got_k is k  # turned in place, inside the qkv tensor
    torch.testing.assert_close(q, want_q, **ROPE_TOL[dtype])
    torch.testing.assert_close(k, want_k, **ROPE_TOL[dtype])
    qc, kc = rand(N, 2, D, dtype=dtype), rand(N, 1, D, dtype=dtype)  # contiguous, MQA
    want_q, want_k = rope.forward_native(qc, kc, cos, sin)
    rope.forward_cpu(qc, kc, cos, sin)
    torch.testing.assert_close((qc, kc), (want_q, want_k), **ROPE_TOL[dtype])


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [0, 1, 21])
@pytest.mark.parametrize("heads_apart", [False, True])
def test_reshape_and_cache_fills_the_slots_index_copy_fills(dtype, N, heads_apart):
    """csrc/cache.cpp against `index_copy_` into the flat pool (fp8_kv.write_slots), from the strided views of a
    fused qkv output (a token's heads side by side) and from views whose heads lie apart (one copy per head)."""
    torch.manual_seed(N)
    H, Hkv, D, blocks, block = 6, 2, 64, 4, 8
    if heads_apart:  # [N, Hkv, D] with head stride N * D: the heads of a token are not next to each other
        k, v = (rand(Hkv, N, D, dtype=dtype).transpose(0, 1) for _ in range(2))
    else:
        _, k, v = qkv_views(N, H, Hkv, D, dtype)
    slots = torch.randperm(blocks * block)[:N]
    want_kc, want_vc = torch.zeros(2, blocks, block, Hkv, D, dtype=dtype).unbind(0)
    write_slots(want_kc, slots, k)
    write_slots(want_vc, slots, v)
    k_cache, v_cache = torch.zeros(2, blocks, block, Hkv, D, dtype=dtype).unbind(0)
    torch.ops.roseinfer.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)  # copies: bit for bit, the rest 0
    k_cache.zero_()
    write_kv_flat(k, v, k_cache, v_cache, slots)  # the backends' write goes to the op on a CPU
    assert torch.equal(k_cache, want_kc)


@needs_ops
@torch.inference_mode()
def test_reshape_and_cache_names_what_is_wrong():
    k_cache, v_cache = torch.zeros(2, 4, 8, 2, 64).unbind(0)
    k, v = rand(3, 2, 64), rand(3, 2, 64)
    op = torch.ops.roseinfer.reshape_and_cache
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(k, v, k_cache, v_cache, torch.tensor([0, 32, 1]))
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(k, v, k_cache, v_cache, torch.tensor([0, -1, 1]))
    assert not k_cache.any()  # slots are checked before anything is written
    with pytest.raises(RuntimeError, match="slot_mapping must be .N. int64"):
        op(k, v, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="key must be in the pool's dtype"):
        op(k.bfloat16(), v, k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="value must be .N, Hkv, D. with the pool's Hkv and D"):
        op(k, rand(3, 4, 32), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="same tokens"):
        op(k, v[:2], k_cache, v_cache, torch.tensor([0, 1, 2]))


@needs_ops
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("N", [0, 1, 21])
def test_rotary_with_the_kv_write_fills_the_slots_the_flat_write_fills(dtype, index_dtype, N):
    torch.manual_seed(N)
    H, Hkv, D, blocks, block = 6, 2, 64, 4, 8
    rope = ApplyRotary(True)
    q, k, v = qkv_views(N, H, Hkv, D, dtype)
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.arange(N) * 7, dtype)
    slots = torch.randperm(blocks * block)[:N]
    want_kc, want_vc = torch.zeros(2, blocks, block, Hkv, D, dtype=dtype).unbind(0)
    want_q, want_k = rope.forward_native(q, k, cos, sin)
    write_slots(want_kc, slots, want_k)  # index_copy_, the PyTorch write
    write_slots(want_vc, slots, v)
    k_cache, v_cache = torch.zeros(2, blocks, block, Hkv, D, dtype=dtype).unbind(0)
    rope.set_impl("auto")
    got_q, got_k = rope.forward_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots.to(index_dtype))
    torch.testing.assert_close((got_q, got_k), (want_q, want_k), **ROPE_TOL[dtype])
    torch.testing.assert_close((k_cache, v_cache), (want_kc, want_vc), **ROPE_TOL[dtype])  # the other slots stay 0
    if N:
        with pytest.raises(RuntimeError, match="outside the pool"):
            torch.ops.roseinfer.rotary_embedding_write_kv(q, k, v, cos, sin, k_cache, v_cache,
                                                          torch.full((N,), blocks * block), True)  # fmt: skip


@needs_ops
@torch.inference_mode()
def test_what_the_kernels_do_not_take_runs_the_reference():
    """fp64, the dense path's [B, T, H, D] rotation and a weight in another dtype fall back to forward_native."""
    norm, rope, act = make_norm(8, torch.float64), ApplyRotary(True), SiluAndMul()
    x = rand(3, 8, dtype=torch.float64)
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x))
    torch.testing.assert_close(act.forward_cpu(x), act.forward_native(x))
    q, k = rand(2, 5, 4, 8), rand(2, 5, 2, 8)
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.arange(5), torch.float32)  # [T, 1, D], broadcast over B
    torch.testing.assert_close(rope.forward_cpu(q, k, cos, sin), rope.forward_native(q, k, cos, sin))
    x32 = rand(3, 8)
    torch.testing.assert_close(norm.forward_cpu(x32), norm.forward_native(x32))  # fp64 weight, fp32 x


@needs_ops
def test_auto_picks_the_cpu_kernel_and_native_the_reference():
    norm = RMSNorm(4, 1e-6)
    assert norm.choose(torch.device("cpu")) == norm.forward_cpu
    set_custom_op_impl(torch.nn.Sequential(norm), "native")
    assert norm.choose(torch.device("cpu")) == norm.forward_native
    with pytest.raises(ValueError, match="unknown custom_ops 'fused'"):
        norm.set_impl("fused")


# ---- the model ---------------------------------------------------------------------------------------------
PROMPTS = [[5, 17, 200, 33, 9], [100, 101, 102, 7, 7, 8, 250, 3, 1, 2, 3], [42], list(range(60, 97))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    out = {}
    for name, arch, kw in (("llama", "LlamaForCausalLM", {}), ("qwen3", "Qwen3ForCausalLM", dict(head_dim=32))):
        d = tmp_path_factory.mktemp(name)
        make_llama_checkpoint(d, arch, **kw)
        out[name] = d
    return out


def run(model_dir, **kw):
    """(greedy tokens, every logprob of the prompts and the outputs) per prompt."""
    with LLM(str(model_dir), device="cpu", dtype="float32", **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp.logprob for pos in o.prompt_logprobs[1:] + o.outputs[0].logprobs for lp in pos.values()]
                for o in outs]  # fmt: skip
    return tokens, logprobs


def spy(monkeypatch, cls, name: str) -> list:
    calls, original = [], getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


@needs_ops
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_fused_model_gives_the_references_tokens_and_logprobs(llama_dirs, name, backend, monkeypatch):
    """ "auto" runs every fused kernel (the K/V write in the rotation's pass with the cpu backend's flat layout,
    the separate write with the torch backend's) and matches "native": the same greedy tokens, logprobs close."""
    want_tokens, want_lp = run(llama_dirs[name], custom_ops="native", attention_backend=backend)
    norm_calls, act_calls, rope_calls = (spy(monkeypatch, c, "forward_cpu") for c in (RMSNorm, SiluAndMul, ApplyRotary))
    tokens, lp = run(llama_dirs[name], custom_ops="auto", attention_backend=backend)
    assert norm_calls and act_calls
    assert bool(rope_calls) == (backend == "torch")  # the cpu backend's rotation runs inside forward_write_kv
    assert tokens == want_tokens
    for a, b in zip(lp, want_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
def test_compile_mode_runs_and_gives_the_same_tokens(llama_dirs):
    with LLM(str(llama_dirs["llama"]), device="cpu", dtype="float32", custom_ops="compile") as llm:
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    want, _ = run(llama_dirs["llama"], custom_ops="native")
    assert [o.outputs[0].token_ids for o in outs] == [t[:4] for t in want[:2]]


def test_the_custom_ops_setting_is_checked_and_is_a_flag():
    with pytest.raises(ValueError, match="unknown custom_ops 'fused'"):
        EngineArgs(device="cpu", custom_ops="fused").create_engine_config()
    with pytest.raises(TypeError, match="custom_ops must be one of"):
        EngineArgs(device="cpu", custom_ops=None).create_engine_config()
    assert EngineArgs(device="cpu").create_engine_config().model_config.custom_ops == "auto"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--custom-ops", "native"])).custom_ops == "native"
    with pytest.raises(ValueError, match="unknown custom_ops"):
        EngineArgs.from_cli_args(parser.parse_args(["--custom-ops", "fused"])).create_engine_config()
    with pytest.raises(ValueError, match="unknown custom_ops"):
        LLM(custom_ops="Native")
