"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: "compressed-tensors"`): which ones
roseinfer runs, and how their tensors become `Int8Linear` layers.

What a W8A8 int8 checkpoint's config.json carries (the fields vLLM's CompressedTensorsW8A8Int8 scheme reads):

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights":           {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head"]}

and, for every linear layer of the decoder, `<layer>.weight` int8 [out, in] and `<layer>.weight_scale` [out, 1];
with static activations ("strategy": "tensor", "dynamic": false) also `<layer>.input_scale` [1]. Everything else
(AWQ, GPTQ, fp8, int4, per-tensor or group weight scales, asymmetric zero points, a quantized KV cache) is
refused by name: `parse_quantization_config` is called from the config check of the Llama family
(llama_config.py), so a checkpoint we cannot run fails before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from roseinfer.model_executor.quantization.int8_linear import Int8Linear

SUPPORTED = ("compressed-tensors W8A8 int8: weights int8 symmetric per channel, activations int8 symmetric "
             "dynamic per token or static per tensor, format 'int-quantized'")  # fmt: skip
QUANTIZED_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Int8QuantConfig:
    """What the model needs to know: every decoder linear is W8A8 int8; `static_input`: activations use the
    checkpoint's per-tensor `input_scale` (else a scale per token, computed at run time)."""

    static_input: bool
    quant_method: str = "compressed-tensors"


def _refuse(field: str, value, allowed: str) -> None:
    raise ValueError(f"config.json: quantization_config {field}={value!r} is not supported; it must be {allowed}. "
                     f"roseinfer runs {SUPPORTED}")  # fmt: skip


def _check_args(where: str, args, expect: dict) -> None:
    if not isinstance(args, dict):
        _refuse(where, args, "an object")
    for key, allowed in expect.items():
        if args.get(key) not in allowed:
            _refuse(f"{where}.{key}", args.get(key), " or ".join(repr(a) for a in allowed))


def parse_quantization_config(qc) -> Int8QuantConfig:
    """config.json's `quantization_config` -> Int8QuantConfig, or a ValueError naming the field we cannot run."""
    if not isinstance(qc, dict):
        _refuse("", qc, "an object")
    if qc.get("quant_method") != "compressed-tensors":
        _refuse("quant_method", qc.get("quant_method"), "'compressed-tensors'")
    if qc.get("format") != "int-quantized":
        _refuse("format", qc.get("format"), "'int-quantized'")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            _refuse(key, qc[key], "null (not implemented)")
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse("quantization_status", qc["quantization_status"], "'compressed'")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse("config_groups", groups, "an object of one or more groups")
    static = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            _refuse(where, group, "an object")
        if group.get("targets") != ["Linear"]:
            _refuse(f"{where}.targets", group.get("targets"), "['Linear']")
        if group.get("format") not in (None, "int-quantized"):
            _refuse(f"{where}.format", group["format"], "'int-quantized' or absent")
        if group.get("output_activations") is not None:
            _refuse(f"{where}.output_activations", group["output_activations"], "null")
        w = group.get("weights")
        _check_args(f"{where}.weights", w, dict(num_bits=(8,), type=("int",), symmetric=(True,),
                    strategy=("channel",), dynamic=(False, None), group_size=(None,)))  # fmt: skip
        a = group.get("input_activations")
        if a is None:
            _refuse(f"{where}.input_activations", a, "int8 activations (W8A8; weight-only int8 is not loaded yet)")
        _check_args(f"{where}.input_activations", a, dict(num_bits=(8,), type=("int",), symmetric=(True,),
                    strategy=("token", "tensor"), group_size=(None,)))  # fmt: skip
        if a.get("dynamic") is not (a["strategy"] == "token"):
            _refuse(f"{where}.input_activations.dynamic", a.get("dynamic"),
                    "true with strategy 'token', false with strategy 'tensor'")  # fmt: skip
        static.add(a["strategy"] == "tensor")
    if len(static) > 1:
        _refuse("config_groups", sorted(groups), "groups that all quantize activations the same way")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        _refuse("ignore", ignore, "a list of module names")
    probes = [f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for p in QUANTIZED_PROJS]
    for entry in ignore:  # the head may stay float (it is never quantized here); a decoder linear may not
        if entry.startswith("re:"):
            ok = re.fullmatch(entry[3:], "lm_head") and not any(re.fullmatch(entry[3:], p) for p in probes)
        else:
            ok = entry == "lm_head"
        if not ok:
            _refuse("ignore", ignore, "['lm_head'] or empty (every linear of the decoder layers quantized)")
    return Int8QuantConfig(static_input=static.pop())


def use_int8_linears(model: nn.Module, quant: Int8QuantConfig, tp_size: int) -> None:
    """Swap every linear layer of `model` (the decoder layers, not the embeddings or the head) for an
    Int8Linear of the same shape: what vLLM does by giving each LinearBase the scheme's quant method."""
    if tp_size != 1:
        raise ValueError(f"quantized checkpoints run with tensor_parallel_size=1, not {tp_size}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                q = Int8Linear(child.in_features, child.out_features, child.bias is not None, quant.static_input)
                setattr(parent, name, q)


def process_weights_after_loading(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.process_weights_after_loading()


def check_quantized_state_dict(sd: dict[str, torch.Tensor], quant: Int8QuantConfig) -> dict[str, torch.Tensor]:
    """Every decoder linear's `weight` must be int8 with its `weight_scale` (and `input_scale` when static);
    zero points (symmetric: all zeros) are dropped. Returns the state dict without them."""
    out = {}
    for name, t in sd.items():
        if name.endswith("_zero_point"):
            if t.any():
                raise ValueError(f"checkpoint: {name} is not zero, but the scheme is symmetric")
            continue
        out[name] = t
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in QUANTIZED_PROJS:
            continue
        if t.dtype != torch.int8:
            raise ValueError(f"checkpoint: {name} is {t.dtype}, but quantization_config says int8 weights")
        needed = ["weight_scale"] + (["input_scale"] if quant.static_input else [])
        for leaf in needed:
            if f"{prefix}.{leaf}" not in sd:
                raise ValueError(f"checkpoint: {prefix}.{leaf} is missing (needed by {prefix}.weight, int8)")
    return out
