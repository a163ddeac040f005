"""Read a Hugging Face GPT-2 `config.json`: every field that changes the math is either
implemented or refused here, never ignored.

    implemented  n_positions n_embd n_layer n_head vocab_size layer_norm_epsilon
                 n_inner (the MLP width; null = 4·n_embd)
                 activation_function (see roseinfer/model_executor/activations.py)
                 scale_attn_weights (q·kᵀ/√D, or no scaling at all)
                 scale_attn_by_inverse_layer_idx (also divide by layer index + 1)
                 tie_word_embeddings (false: the checkpoint's own lm_head.weight)
                 eos_token_id (one id, a list of ids, or null for "never stop at EOS"; the loader takes
                 it from generation_config.json when that file exists, as transformers' generate does)
                 quantization_config: compressed-tensors W8A8 or W8A16 int8, the same schemes as the Llama
                     family (quantization/compressed_tensors.py checks every field and refuses the rest)
    accepted     reorder_and_upcast_attn: it changes where the scale is applied and runs the
                 softmax in fp32 under mixed precision, not the function computed. transformers
                 itself only honours it in its "eager" attention; our SDPA and paged kernels
                 already accumulate the softmax in fp32.
    ignored      dropout (*_pdrop), initializer_range, summary_* (GPT2DoubleHeadsModel only),
                 use_cache, bos/pad ids, and n_ctx, which transformers ignores too (the context
                 is n_positions)
    refused      model_type other than gpt2, add_cross_attention, other quantization methods,
                 n_embd not divisible by n_head, bad values
"""

from __future__ import annotations

import math

from roseinfer.checks import is_int
from roseinfer.model_executor.activations import get_activation
from roseinfer.model_executor.llama_config import eos_token_ids
from roseinfer.model_executor.quantization.compressed_tensors import GPT2_LINEARS, parse_quantization_config

DEFAULTS = dict(  # transformers' GPT2Config defaults: a field missing from config.json means these
    vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
    activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
    tie_word_embeddings=True, eos_token_id=50256,
)  # fmt: skip

_OURS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
         "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
         "tie_word_embeddings")  # fmt: skip


def config_kwargs_from_hf(hf: dict) -> dict:
    """config.json dict -> keyword arguments for `GPT2Config` (roseinfer/model_executor/gpt2.py); a ValueError if
    we cannot run it."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"roseinfer runs GPT-2 models, got model_type={hf.get('model_type')!r}")
    quant = parse_quantization_config(hf["quantization_config"], GPT2_LINEARS) if "quantization_config" in hf else None
    c = {**DEFAULTS, **{k: hf[k] for k in DEFAULTS if k in hf}}
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        _require(is_int(c[name]) and c[name] >= 1, name, c[name], "an int >= 1")
    if c["n_embd"] % c["n_head"]:
        raise ValueError(f"n_embd={c['n_embd']} must be divisible by n_head={c['n_head']}")
    _require(c["n_inner"] is None or (is_int(c["n_inner"]) and c["n_inner"] >= 1), "n_inner", c["n_inner"],
             "null (4 * n_embd) or an int >= 1")  # fmt: skip
    eps = c["layer_norm_epsilon"]
    _require(_is_number(eps) and math.isfinite(eps) and eps > 0, "layer_norm_epsilon", eps, "a finite number > 0")
    act = c["activation_function"]
    _require(isinstance(act, str), "activation_function", act, "a name from transformers' ACT2FN")
    get_activation(act)  # raises for names we do not implement
    for name in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention", "tie_word_embeddings"):  # fmt: skip
        _require(isinstance(c[name], bool), name, c[name], "true or false")
    if c["add_cross_attention"]:
        raise ValueError("add_cross_attention=true (the decoder of an encoder-decoder model) is not supported")
    eos = eos_token_ids(c["eos_token_id"])
    return {**{k: c[k] for k in _OURS}, "eos_token_id": eos[0] if eos else None, "eos_token_ids": eos,
            "quantization": quant}  # fmt: skip


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config.json: {name}={value!r} is not supported; it must be {allowed}")
