"""Which model class runs a checkpoint: config.json's `architectures` names it, as in vLLM.

    config.json {"architectures": ["Qwen3ForCausalLM"], ...}
        └─► ModelSpec: read the config (every field checked)  ─► build the module  ─► rename its weights

Every class has the same interface for the engine: `forward_paged(input_ids, positions, kv_caches, meta)`,
`compute_logits(hidden)`, `pack_linears(backend)`, and `convert_state_dict(sd, cfg, tp_rank, tp_size)`
(a transformers checkpoint -> this module's names, this rank's shard). Configs share the engine's view:
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size, intermediate_size,
max_position_embeddings, vocab_size, eos_token_id(s), sliding_window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from roseinfer.model_executor.gpt2 import GPT2, GPT2Config
from roseinfer.model_executor.llama import LlamaForCausalLM
from roseinfer.model_executor.llama_config import ARCHITECTURES, LlamaConfig

ModelConfigType = GPT2Config | LlamaConfig


@dataclass(frozen=True)
class ModelSpec:
    read_config: Callable[[dict], ModelConfigType]
    model_class: type[nn.Module]


MODELS: dict[str, ModelSpec] = {
    "GPT2LMHeadModel": ModelSpec(GPT2Config.from_hf, GPT2),
    **{arch: ModelSpec(LlamaConfig.from_hf, LlamaForCausalLM) for arch in ARCHITECTURES},
}
_BY_MODEL_TYPE = {"gpt2": "GPT2LMHeadModel", **{t: arch for arch, (t, _) in ARCHITECTURES.items()}}


def architecture_of(hf: dict) -> str:
    """config.json's `architectures[0]` (or, for old files without it, the class its `model_type` means)."""
    archs = hf.get("architectures")
    if archs is None:
        arch = _BY_MODEL_TYPE.get(hf.get("model_type", "gpt2"))
        if arch is None:
            raise ValueError(f"config.json: model_type={hf.get('model_type')!r} is not supported; roseinfer runs "
                             f"{sorted(MODELS)}")  # fmt: skip
        return arch
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ValueError(f"config.json: architectures={archs!r}; expected one class name, e.g. ['LlamaForCausalLM']")
    if archs[0] not in MODELS:
        raise ValueError(f"config.json: architectures={archs!r} is not supported; roseinfer runs {sorted(MODELS)}")
    return archs[0]


def get_model_spec(hf: dict) -> ModelSpec:
    return MODELS[architecture_of(hf)]


def model_class_of(cfg: ModelConfigType) -> type[nn.Module]:
    """The class that runs a config read by `get_model_spec(...).read_config`."""
    return MODELS[cfg.architecture].model_class
