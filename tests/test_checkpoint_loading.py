"""Real GPT-2 checkpoint directories load and match transformers, or are refused clearly.

Every directory is made here from random weights saved by transformers; every expected
answer comes from transformers in the same test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, make_random_checkpoint

from roseinfer import DEFAULT_MODEL, LLM, InferenceEngine
from roseinfer.activations import ACTIVATIONS
from roseinfer.loader import load_model

SMALL = dict(n_positions=64, n_embd=32, n_layer=2, n_head=2)


def _hf(model_dir: Path, **kw):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    path.write_text(json.dumps(data))


# ---- 1. config.json fields that change the math ------------------------------------------------
IMPLEMENTED = [
    {"n_inner": 48},
    {"scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False},
    {"layer_norm_epsilon": 1e-2},
    {"reorder_and_upcast_attn": True},
    *({"activation_function": name} for name in ACTIVATIONS),
]


@pytest.mark.parametrize("overrides", IMPLEMENTED, ids=["=".join(map(str, *o.items())) for o in IMPLEMENTED])
def test_implemented_config_field_matches_transformers(tmp_path, overrides):
    model_dir = make_random_checkpoint(tmp_path / "m", seed=2, initializer_range=0.5, **SMALL, **overrides)
    eager = {"attn_implementation": "eager"} if "reorder_and_upcast_attn" in overrides else {}  # only eager honours it
    hf_model = _hf(model_dir, **eager)
    # an activation is the same code in prefill and decode: logits are enough (and keep the test fast)
    _assert_matches_transformers(model_dir, hf_model, greedy="activation_function" not in overrides)


def test_untied_lm_head_matches_transformers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=4096, tie_word_embeddings=False, eos_token_id=4095, **SMALL))
    with torch.no_grad():  # an LM head of its own, close enough to wte that greedy text is not one token
        model.lm_head.weight.copy_(model.transformer.wte.weight * 20 + torch.randn_like(model.lm_head.weight))
    model.save_pretrained(tmp_path / "m")
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.tiktoken", tmp_path / "m")
    ours, _ = load_model(tmp_path / "m", torch.device("cpu"), torch.float32)
    assert ours.lm_head is not None and not torch.equal(ours.lm_head.weight, ours.transformer.wte.weight)
    _assert_matches_transformers(tmp_path / "m", model.eval())


EOS_CASES = [  # (config.json's eos_token_id, generation_config.json's: a value, "no key" or "no file")
    (None, "no file"),  # never stops
    (4095, "no key"),  # generation_config.json wins: never stops
    (4095, 7),  # never stops (7 is never generated)
    (7, 4095),  # stops at 4095
    (4095, "no file"),  # stops at 4095
]


@pytest.mark.parametrize(("config_eos", "generation_eos"), EOS_CASES, ids=[f"{c}-{g}" for c, g in EOS_CASES])
def test_eos_token_id_is_the_one_transformers_generate_uses(tmp_path, config_eos, generation_eos):
    from test_01_naive_decode import eos_always_checkpoint

    model_dir = eos_always_checkpoint(tmp_path / "m")  # its argmax is always token 4095
    _edit_json(model_dir / "config.json", eos_token_id=config_eos)
    generation = model_dir / "generation_config.json"
    if generation_eos == "no file":
        generation.unlink()
    else:
        data = json.loads(generation.read_text())
        data.pop("eos_token_id")
        generation.write_text(
            json.dumps(data if generation_eos == "no key" else {**data, "eos_token_id": generation_eos})
        )
    engine = InferenceEngine(model_dir, device="cpu")
    hf_model = _hf(model_dir)
    want = hf_greedy(hf_model, [1, 2, 3], 6)
    assert engine.generate_ids([1, 2, 3], 6) == want
    stops = generation_eos == 4095 or (config_eos, generation_eos) == (4095, "no file")
    assert want == ([4095] if stops else [4095] * 6)


def _assert_matches_transformers(model_dir: Path, hf_model, greedy: bool = True) -> None:
    """Same logits as transformers on random ids; and greedy text through the engine (paged decode)."""
    ids = torch.randint(0, 4095, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(ids).logits, rtol=1e-4, atol=1e-4)
    if not greedy:
        return
    engine = InferenceEngine(model_dir, device="cpu", dtype="float32")  # prefill + paged decode
    prompt = ids[0, :8].tolist()
    want = hf_greedy(hf_model, prompt, 12)
    assert engine.generate_ids(prompt, 12) == want
    assert len(set(want)) > 2, "random weights should not repeat one token"


REFUSED = [
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"activation_function": "prelu"}, "activation_function='prelu'.*learned weights"),
    ({"activation_function": "xielu"}, "activation_function='xielu'"),
    ({"activation_function": "gelu_sparkly"}, "activation_function='gelu_sparkly'"),
    ({"model_type": "gpt_neo"}, "model_type"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"n_head": 3}, "divisible by n_head"),
    ({"n_inner": 0}, "n_inner"),
    ({"n_inner": 100}, "does not match its config.json"),  # the weights are 4 * n_embd wide
    ({"vocab_size": 5000}, "does not match its config.json"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon"),
    ({"scale_attn_weights": "yes"}, "scale_attn_weights"),
    ({"eos_token_id": [4095, 4094]}, "eos_token_id"),
    ({"tie_word_embeddings": False}, "lm_head.weight"),  # untied, but the checkpoint has no head of its own
    ({"n_layer": 3}, "missing"),
]


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("base"), **SMALL)


@pytest.mark.parametrize(("changes", "match"), REFUSED, ids=["=".join(map(str, *c.items()))[:40] for c, _ in REFUSED])
def test_unsupported_config_field_is_refused_at_load(tmp_path, base_checkpoint, changes, match):
    model_dir = tmp_path / "m"
    shutil.copytree(base_checkpoint, model_dir)
    (model_dir / "generation_config.json").unlink()  # so that config.json's eos_token_id counts
    _edit_json(model_dir / "config.json", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, device="cpu")
