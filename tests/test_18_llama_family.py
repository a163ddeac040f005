"""Stage 18: Llama, Mistral, Qwen2 and Qwen3 checkpoints (RoPE, RMSNorm, SwiGLU, grouped-query attention).

Every model is a random-weight directory written by transformers' own classes; the reference is
transformers' greedy `generate` on the same weights, in fp32.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_llama_checkpoint

from roseinfer import LLM, SamplingParams
from roseinfer.config import EngineArgs

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
CASES = {  # name -> (architecture, config overrides)
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-mha-untied": ("LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-mqa-tied-llama3-rope": ("LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                            rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama-attention-and-mlp-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2-qkv-bias-tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-head-dim-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=1)),
}  # fmt: skip
PROMPTS = [[5, 17, 200, 33, 9], [100, 101, 102, 7, 7, 8, 250, 3, 1, 2, 3], [42], list(range(60, 97))]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model, its greedy continuations of PROMPTS)."""
    out = {}
    for name, (arch, overrides) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        model = make_llama_checkpoint(d, arch, **overrides)
        out[name] = (d, model, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS])
    return out


def generate(model_dir, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[int]]:
    with LLM(str(model_dir), device="cpu", dtype="float32", **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["auto", "sdpa", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_transformers(checkpoints, name, backend):
    model_dir, _, expected = checkpoints[name]
    assert generate(model_dir, attention_backend=backend) == expected


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-head-dim-qk-norm"])
def test_chunked_prefill_at_a_tiny_budget_and_one_request_at_a_time_give_the_same_tokens(checkpoints, name):
    model_dir, _, expected = checkpoints[name]
    assert generate(model_dir, max_num_batched_tokens=4, enable_chunked_prefill=True) == expected
    assert [generate(model_dir, [p])[0] for p in PROMPTS] == expected  # batched == unbatched
    assert generate(model_dir, max_num_seqs=1, linear_backend="aten") == expected


def test_prefix_caching_preemption_and_swap_keep_the_tokens(checkpoints):
    model_dir, _, expected = checkpoints["llama-gqa"]
    shared = PROMPTS[3]
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
    ref = generate(model_dir, prompts, enable_prefix_caching=False)
    assert generate(model_dir, prompts, enable_prefix_caching=True) == ref
    tight = dict(num_blocks=9, block_size=8, max_num_seqs=3)  # too few blocks for three: someone is preempted
    assert generate(model_dir, prompts, preemption_mode="swap", **tight) == ref
    assert generate(model_dir, prompts, preemption_mode="recompute", **tight) == ref


def test_n_and_beam_search_share_blocks_copy_on_write_and_beams_equal_transformers(checkpoints):
    from roseinfer.sampling_params import BeamSearchParams

    model_dir, model, expected = checkpoints["llama-mqa-tied-llama3-rope"]
    params = SamplingParams(n=3, max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", dtype="float32", block_size=4) as llm:
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e] * 3 for e in expected[:2]]
        beams = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        hf = model.generate(x, attention_mask=torch.ones_like(x), num_beams=3, num_return_sequences=3,
                            max_new_tokens=8, do_sample=False, early_stopping=True, eos_token_id=None,
                            pad_token_id=0)  # fmt: skip
    assert [s.token_ids for s in beams[0].sequences] == [row[len(PROMPTS[1]) :].tolist() for row in hf]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_the_greedy_tokens(checkpoints, method, tmp_path):
    model_dir, _, expected = checkpoints["llama-gqa"]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":  # a smaller Qwen3 with the same vocabulary drafts for the Llama
        make_llama_checkpoint(tmp_path, "Qwen3ForCausalLM", num_hidden_layers=1, head_dim=16, seed=3)
        spec["model"] = str(tmp_path)
    assert generate(model_dir, speculative_config=spec) == expected


def test_tensor_parallel_splits_kv_heads_and_gives_the_same_tokens(checkpoints):
    model_dir, _, expected = checkpoints["llama-gqa"]  # 4 query heads, 2 K/V heads: one K/V head per rank
    with LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        assert llm.llm_engine.config.model_config.kv_bytes_per_token(2) * 2 == 2 * 2 * 2 * 16 * 4
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_tensor_parallel_size_must_divide_the_kv_heads(checkpoints):
    model_dir, _, _ = checkpoints["mistral"]  # one K/V head
    with pytest.raises(ValueError, match=r"must divide the model's num_key_value_heads=1"):
        EngineArgs(model=str(model_dir), device="cpu", tensor_parallel_size=2).create_engine_config()


@pytest.mark.parametrize("save", ["sharded", "bf16", "fp16"])
def test_sharded_and_half_precision_checkpoints(tmp_path, save):
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    kw = {"max_shard_size": "40KB"} if save == "sharded" else {"save_dtype": dtypes[save]}
    model = make_llama_checkpoint(tmp_path, "LlamaForCausalLM", **kw)
    if save == "sharded":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    assert generate(tmp_path) == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def test_gqa_kv_cache_holds_more_tokens_in_the_same_memory(checkpoints):
    """KV bytes per token follow num_key_value_heads: 4 query heads over 1 K/V head hold 4x the blocks."""
    blocks = {}
    for name in ("llama-mha-untied", "llama-gqa", "llama-mqa-tied-llama3-rope"):
        cfg = EngineArgs(model=str(checkpoints[name][0]), device="cpu", kv_cache_memory=2**20).create_engine_config()
        blocks[cfg.model_config.hf_config.num_key_value_heads] = cfg.cache_config.num_gpu_blocks
        assert cfg.model_config.kv_bytes_per_token() == 2 * 2 * cfg.model_config.hf_config.num_key_value_heads * 16 * 4
    assert blocks[2] == 2 * blocks[4] and blocks[1] == 4 * blocks[4]


def test_several_eos_ids_each_end_a_sequence(tmp_path):
    model = make_llama_checkpoint(tmp_path)
    free = hf_greedy(model, PROMPTS[0], 12)
    first, second = free[3], free[6]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [second, first]}))
    with LLM(str(tmp_path), device="cpu", dtype="float32") as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[: free.index(first) + 1] and out.finish_reason == "stop"
        assert llm.llm_engine.config.model_config.eos_token_ids == (second, first)
        ignored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert ignored.token_ids == free


# ---- what is refused, by name ------------------------------------------------------------------------------
def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(architectures=["GemmaForCausalLM"]), r"architectures=\['GemmaForCausalLM'\] is not supported; "
                                                   r"roseinfer runs \['GPT2LMHeadModel', 'LlamaForCausalLM'"),
        (dict(architectures=None, model_type="phi"), r"model_type='phi' is not supported"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), r"rope_type='yarn'"),
        (dict(num_key_value_heads=3), r"num_key_value_heads=3 .* divides num_attention_heads=4"),
        (dict(layer_types=["full_attention", "sliding_attention"]), r"sliding-window layers are not supported"),
        (dict(quantization_config={"quant_method": "awq"}), r"quantization_config"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         r"partial_rotary_factor"),
    ],
)  # fmt: skip
def test_config_fields_we_do_not_implement_are_refused_by_name(tmp_path, changes, match):
    make_llama_checkpoint(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def test_mistral_sliding_window_shorter_than_the_context_is_refused_unless_max_model_len_fits(tmp_path):
    model = make_llama_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=32)
    with pytest.raises(ValueError, match=r"sliding_window=32 is shorter than the context served \(128\)"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    prompts = [p for p in PROMPTS if len(p) + GREEDY.max_tokens <= 32]
    got = generate(tmp_path, prompts, max_model_len=32)  # no sequence outgrows the window: full attention is exact
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_a_missing_shard_is_named(tmp_path):
    make_llama_checkpoint(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard '{shard.name}', named in .*model.safetensors.index.json"):
        LLM(str(tmp_path), device="cpu")


def test_a_missing_tokenizer_is_named(tmp_path):
    make_llama_checkpoint(tmp_path, tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer found for model"):
        LLM(str(tmp_path), device="cpu")
