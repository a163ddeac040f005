"""The Llama family's `config.json` (Llama 2/3.x, Qwen2, Qwen3, Mistral, SmolLM2): what each field does
to the math, implemented or refused by name, never ignored.

    implemented  vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
                 num_key_value_heads (grouped-query attention; null = num_attention_heads)
                 head_dim (Qwen3, Mistral: may differ from hidden_size / num_attention_heads)
                 max_position_embeddings rms_norm_eps tie_word_embeddings
                 rope_theta + rope_scaling, or transformers 5's rope_parameters: rope_type
                     "default", "linear" or "llama3" (rotary_embedding.py)
                 attention_bias (Llama, Qwen3: a bias on q/k/v/o), mlp_bias (Llama)
                 Qwen2: a bias on q/k/v always;  Qwen3: RMSNorm on each head of q and k
                 sliding_window (Mistral; Qwen with use_sliding_window): kept, and the engine refuses a
                     window shorter than the context it runs (config.py), since it attends to everything
                 eos_token_id (one id or a list; generation_config.json's list wins, as in transformers)
                 quantization_config: compressed-tensors W8A8 or W8A16 int8 (quantization/compressed_tensors.py
                     checks every field; any other method, format or scheme is refused there)
    ignored      dropout, initializer_range, use_cache, pad/bos ids, pretraining_tp (transformers ignores
                 it at inference too), max_window_layers without use_sliding_window, torch_dtype/dtype
    refused      hidden_act other than silu, other rope types, partial_rotary_factor != 1, layer_types
                 with sliding layers, other quantization methods, heads that do not divide, bad values
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from roseinfer.checks import is_int
from roseinfer.model_executor.quantization.compressed_tensors import Int8QuantConfig, parse_quantization_config

ARCHITECTURES = {  # config.json's `architectures[0]` -> its model_type and transformers' defaults
    "LlamaForCausalLM": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048)),
    "MistralForCausalLM": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           max_position_embeddings=4096 * 32, sliding_window=4096)),
    "Qwen2ForCausalLM": ("qwen2", dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=32768)),
    "Qwen3ForCausalLM": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                         max_position_embeddings=32768)),
}  # fmt: skip
COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
              mlp_bias=False, rope_theta=10000.0, num_key_value_heads=None, head_dim=None)  # fmt: skip
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    architecture: str  # "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU's width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads; each serves num_attention_heads / num_key_value_heads query heads
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear" | "llama3", "factor": ..., ...}
    tie_word_embeddings: bool
    qkv_bias: bool  # a bias on q, k and v (Qwen2; attention_bias in Llama and Qwen3)
    o_bias: bool  # a bias on the output projection (attention_bias in Llama and Qwen3)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before the rotation
    sliding_window: int | None  # None: every token attends to its whole context
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # any of them ends a sequence
    quantization: Int8QuantConfig | None = None  # None: float weights; else every decoder linear int8 (W8A8 or W8A16)

    @property
    def eos_token_id(self) -> int | None:
        """The main EOS id (the first); the engine treats the others as stop tokens, as vLLM does."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        arch = (hf.get("architectures") or [None])[0]
        model_type, defaults = ARCHITECTURES[arch]
        if hf.get("model_type", model_type) != model_type:
            raise ValueError(f"config.json: architectures={[arch]} but model_type={hf['model_type']!r} "
                             f"(expected {model_type!r})")  # fmt: skip
        quant = parse_quantization_config(hf["quantization_config"]) if "quantization_config" in hf else None
        c = {**COMMON, **defaults, **hf}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):  # fmt: skip
            _require(is_int(c[name]) and c[name] >= 1, name, c[name], "an int >= 1")
        heads = c["num_attention_heads"]
        kv_heads = heads if c["num_key_value_heads"] is None else c["num_key_value_heads"]
        _require(is_int(kv_heads) and kv_heads >= 1 and heads % kv_heads == 0, "num_key_value_heads", kv_heads,
                 f"an int >= 1 that divides num_attention_heads={heads}")  # fmt: skip
        head_dim = c["head_dim"]
        if head_dim is None:
            if c["hidden_size"] % heads:
                raise ValueError(f"config.json: hidden_size={c['hidden_size']} must be divisible by "
                                 f"num_attention_heads={heads} when head_dim is not given")  # fmt: skip
            head_dim = c["hidden_size"] // heads
        _require(is_int(head_dim) and head_dim >= 2 and head_dim % 2 == 0, "head_dim", head_dim, "an even int >= 2")
        _require(c["hidden_act"] == "silu", "hidden_act", c["hidden_act"], "'silu' (SwiGLU)")
        eps = c["rms_norm_eps"]
        _require(_is_number(eps) and math.isfinite(eps) and eps > 0, "rms_norm_eps", eps, "a finite number > 0")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            _require(isinstance(c[name], bool), name, c[name], "true or false")
        theta, scaling = _rope(c)
        return cls(
            architecture=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=float(eps), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings=c["tie_word_embeddings"],
            qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and c["attention_bias"]),
            o_bias=model_type in ("llama", "qwen3") and c["attention_bias"],
            mlp_bias=model_type == "llama" and c["mlp_bias"], qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(c, model_type), eos_token_ids=eos_token_ids(c.get("eos_token_id")),
            quantization=quant,
        )  # fmt: skip


def _rope(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling` pair (checkpoints on the Hub carry the older one)."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or None
    if scaling is not None and not isinstance(scaling, dict):
        _require(False, "rope_scaling", scaling, "null or an object")
    merged = {**(scaling or {}), **params}
    theta = merged.get("rope_theta", c["rope_theta"])
    _require(_is_number(theta) and theta > 0, "rope_theta", theta, "a number > 0")
    kind = merged.get("rope_type", merged.get("type", "default"))
    _require(kind in ROPE_TYPES, "rope_type", kind, f"one of {ROPE_TYPES} (others are not implemented)")
    partial = merged.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    _require(partial == 1.0, "partial_rotary_factor", partial, "1.0 (rotary on the whole head)")
    if kind == "default":
        return float(theta), None
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")  # fmt: skip
    for key in keys:
        _require(_is_number(merged.get(key)) and merged[key] > 0, f"rope {key}", merged.get(key), "a number > 0")
    if kind == "llama3" and merged["low_freq_factor"] >= merged["high_freq_factor"]:
        raise ValueError("config.json: llama3 rope scaling needs low_freq_factor < high_freq_factor")
    return float(theta), {"rope_type": kind, **{k: merged[k] for k in keys}}


def _sliding_window(c: dict, model_type: str) -> int | None:
    layer_types = c.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json: layer_types={sorted(set(layer_types))}: sliding-window layers are not "
                         "supported; roseinfer attends to the whole context in every layer")  # fmt: skip
    if model_type in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        return None  # Qwen keeps a sliding_window value it does not use unless use_sliding_window is true
    window = c.get("sliding_window")
    _require(window is None or (is_int(window) and window >= 1), "sliding_window", window, "null or an int >= 1")
    return window


def eos_token_ids(eos) -> tuple[int, ...]:
    """config.json's (or generation_config.json's) eos_token_id: null, one id or a list -> a tuple of ids."""
    ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    for i in ids:
        _require(is_int(i) and i >= 0, "eos_token_id", eos, "an int >= 0, a list of them, or null")
    return tuple(ids)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config.json: {name}={value!r} is not supported; it must be {allowed}")
