"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: "compressed-tensors"`): which ones
roseinfer runs, and how their tensors become int8 linear layers (int8_linear.py). Two schemes, each in the
format llm-compressor writes it in:

W8A8 int8 (`Int8Linear`), format "int-quantized" (the fields vLLM's CompressedTensorsW8A8Int8 reads):

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights":           {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head"]}

  and, for every linear layer of the decoder, `<layer>.weight` int8 [out, in] and `<layer>.weight_scale`
  [out, 1]; with static activations ("strategy": "tensor", "dynamic": false) also `<layer>.input_scale` [1].

W8A16 int8, weight only (`Int8WeightOnlyLinear`): no "input_activations" (null or absent), format
"pack-quantized" (llm-compressor picks it for every int weight-only scheme of 1 to 8 bits; vLLM runs it as
CompressedTensorsWNA16), weights "strategy": "channel" (the W8A16 preset up to compressed-tensors 0.15) or
"group" with a "group_size" (the preset since 0.16: 128). Per layer:

    <layer>.weight_packed  int32 [out, ceil(in / 4)]  four int8 weights a word: weight + 128 as a byte,
                                                      weight k of a row in byte k % 4 (bits 8·(k % 4) up) of
                                                      word k // 4 (`pack_int8` / `unpack_int8` below)
    <layer>.weight_shape   int64 [2]                  (out, in): what the unpacking trims to
    <layer>.weight_scale   [out, 1] or [out, in / group_size], the model's float dtype

GPT-2's checkpoints store c_attn, c_proj and c_fc as transformers' `Conv1D`, weight [in, out]. Its quantized
directories keep the layout vLLM's GPT-2 loader reads: it transposes every c_attn/c_proj/c_fc tensor whose name
ends in `.weight`, and nothing else. So W8A8's int8 `weight` is stored [in, out] like the float one, while
`weight_scale` [out, 1], `input_scale` [1] and W8A16's `weight_packed` [out, ceil(in / 4)] + `weight_shape`
(out, in) are stored as for any Linear (gpt2.py's `convert_state_dict` follows the same rule).

Everything else (AWQ, GPTQ's own format, fp8, int4, per-tensor weight scales, asymmetric zero points,
activation-ordered groups with a `weight_g_idx`, a quantized KV cache, unpacked weight-only int8) is refused
by name: `parse_quantization_config` is called from the config check of each family (llama_config.py,
hf_config.py for GPT-2), so a checkpoint we cannot run fails before any weight is read.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from roseinfer.model_executor.quantization.int8_linear import Int8Linear, Int8WeightOnlyLinear, _Int8Weights

SUPPORTED = ("compressed-tensors W8A8 int8 (weights int8 symmetric per channel, activations int8 symmetric "
             "dynamic per token or static per tensor, format 'int-quantized') and W8A16 int8 (weights int8 "
             "symmetric per channel or per group, activations float, format 'pack-quantized')")  # fmt: skip
# the last names of a decoder layer's linears in a checkpoint: the Llama family's seven, then GPT-2's three
QUANTIZED_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "c_attn", "c_proj", "c_fc")  # fmt: skip
# layer 0's linears under their checkpoint names, per family: what an `ignore` entry may not name
LLAMA_LINEARS = tuple(f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for p in QUANTIZED_PROJS[:7])
GPT2_LINEARS = ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                "transformer.h.0.mlp.c_proj")  # fmt: skip
FORMATS = {"W8A8": "int-quantized", "W8A16": "pack-quantized"}


@dataclass(frozen=True)
class Int8QuantConfig:
    """What the model needs to know: every decoder linear is int8 under one `scheme`.
    "W8A8": int8 activations too; `static_input`: they use the checkpoint's per-tensor `input_scale` (else a
    scale per token, computed at run time). "W8A16": weights only; `group_size` None: one scale per output
    channel, else one per `group_size` consecutive inputs."""

    static_input: bool = False
    scheme: str = "W8A8"
    group_size: int | None = None
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


def _parse_group(where: str, group) -> Int8QuantConfig:
    """One entry of config_groups -> the scheme it asks for, or a ValueError naming the field."""
    if not isinstance(group, dict):
        _refuse(where, group, "an object")
    if group.get("targets") != ["Linear"]:
        _refuse(f"{where}.targets", group.get("targets"), "['Linear']")
    if group.get("output_activations") is not None:
        _refuse(f"{where}.output_activations", group["output_activations"], "null")
    a = group.get("input_activations")
    scheme = "W8A16" if a is None else "W8A8"
    if group.get("format") not in (None, FORMATS[scheme]):
        _refuse(f"{where}.format", group["format"], f"{FORMATS[scheme]!r} or absent for {scheme} (" +
                ("no input_activations)" if a is None else "int8 input_activations)"))  # fmt: skip
    w = group.get("weights")
    if scheme == "W8A8":
        _check_args(f"{where}.weights", w, dict(num_bits=(8,), type=("int",), symmetric=(True,),
                    strategy=("channel",), dynamic=(False, None), group_size=(None,)))  # fmt: skip
        _check_args(f"{where}.input_activations", a, dict(num_bits=(8,), type=("int",), symmetric=(True,),
                    strategy=("token", "tensor"), group_size=(None,)))  # fmt: skip
        if a.get("dynamic") is not (a["strategy"] == "token"):
            _refuse(f"{where}.input_activations.dynamic", a.get("dynamic"),
                    "true with strategy 'token', false with strategy 'tensor'")  # fmt: skip
        return Int8QuantConfig(static_input=a["strategy"] == "tensor")
    _check_args(f"{where}.weights", w, dict(num_bits=(8,), type=("int",), symmetric=(True,),
                strategy=("channel", "group"), dynamic=(False, None), actorder=(None, "weight", "static")))  # fmt: skip
    g = w.get("group_size")
    if w["strategy"] == "channel" and g is not None:
        _refuse(f"{where}.weights.group_size", g, "null with strategy 'channel'")
    if w["strategy"] == "group" and not (type(g) is int and g > 0):
        _refuse(f"{where}.weights.group_size", g, "a positive integer with strategy 'group'")
    return Int8QuantConfig(scheme="W8A16", group_size=g)


def parse_quantization_config(qc, linears: tuple[str, ...] = LLAMA_LINEARS) -> Int8QuantConfig:
    """config.json's `quantization_config` -> Int8QuantConfig, or a ValueError naming the field we cannot run.
    `linears`: the family's decoder linears (LLAMA_LINEARS, GPT2_LINEARS), none of which `ignore` may name."""
    if not isinstance(qc, dict):
        _refuse("", qc, "an object")
    if qc.get("quant_method") != "compressed-tensors":
        _refuse("quant_method", qc.get("quant_method"), "'compressed-tensors'")
    if qc.get("format") not in FORMATS.values():
        _refuse("format", qc.get("format"), " or ".join(f"{f!r} ({s})" for s, f in FORMATS.items()))
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            _refuse(key, qc[key], "null (not implemented)")
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse("quantization_status", qc["quantization_status"], "'compressed'")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse("config_groups", groups, "an object of one or more groups")
    parsed = {_parse_group(f"config_groups.{name}", group) for name, group in groups.items()}
    if len(parsed) > 1:
        _refuse("config_groups", sorted(groups), "groups that all quantize the same way")
    quant = parsed.pop()
    if qc["format"] != FORMATS[quant.scheme]:
        _refuse("format", qc["format"], f"{FORMATS[quant.scheme]!r} for {quant.scheme}")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        _refuse("ignore", ignore, "a list of module names")
    for entry in ignore:  # the head may stay float (it is never quantized here); a decoder linear may not
        if entry.startswith("re:"):
            ok = re.fullmatch(entry[3:], "lm_head") and not any(re.fullmatch(entry[3:], p) for p in linears)
        else:
            ok = entry == "lm_head"
        if not ok:
            _refuse("ignore", ignore, "['lm_head'] or empty (every linear of the decoder layers quantized)")
    return quant


def pack_int8(w_q: torch.Tensor) -> torch.Tensor:
    """W_q [out, in] int8 -> weight_packed [out, ceil(in / 4)] int32, compressed-tensors' 8-bit packing: each
    weight + 128 as a byte (w ^ 0x80 read unsigned), four bytes a word, the first in the lowest bits. On a
    little-endian machine that is the bytes' own order, so a view does it (zero bytes pad the last word)."""
    assert sys.byteorder == "little", "pack_int8 reads bytes as little-endian int32 words"
    u = w_q.contiguous().view(torch.uint8) ^ 0x80  # [out, in] uint8, w + 128
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % 4))  # [out, 4 · words]
    return u.view(torch.int32)  # [out, words]


def unpack_int8(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """weight_packed [out, words] int32 -> W_q `shape` = [out, in] int8 (`pack_int8` undone)."""
    assert sys.byteorder == "little", "unpack_int8 reads int32 words as little-endian bytes"
    u = packed.contiguous().view(torch.uint8)[:, : shape[1]]  # [out, in] uint8, w + 128
    return (u ^ 0x80).contiguous().view(torch.int8)  # [out, in]


def use_int8_linears(model: nn.Module, quant: Int8QuantConfig, tp_size: int) -> None:
    """Swap every linear layer of `model` (the decoder layers, not the embeddings or the head) for an
    Int8Linear (W8A8) or Int8WeightOnlyLinear (W8A16) of the same shape: what vLLM does by giving each
    LinearBase the scheme's quant method."""
    if tp_size != 1:
        raise ValueError(f"quantized checkpoints run with tensor_parallel_size=1, not {tp_size}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                shape = (child.in_features, child.out_features, child.bias is not None)
                if quant.scheme == "W8A16":
                    setattr(parent, name, Int8WeightOnlyLinear(*shape, group_size=quant.group_size))
                else:
                    setattr(parent, name, Int8Linear(*shape, static_input=quant.static_input))


def process_weights_after_loading(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, _Int8Weights):
            m.process_weights_after_loading()


def check_quantized_state_dict(sd: dict[str, torch.Tensor], quant: Int8QuantConfig) -> dict[str, torch.Tensor]:
    """Every decoder linear's `weight` must be int8 with its `weight_scale` (and `input_scale` when static);
    W8A16's `weight_packed` int32 + `weight_shape` are unpacked into that int8 `weight` [out, in] here, before
    the model's own renaming (Llama fuses q/k/v; GPT-2 transposes the `.weight`s stored as Conv1D, which an
    unpacked weight never was). Zero points (symmetric: all zeros) are dropped. Returns the state dict the
    model loads."""
    out = {}
    for name, t in sd.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf.endswith("_zero_point"):
            if t.any():
                raise ValueError(f"checkpoint: {name} is not zero, but the scheme is symmetric")
            continue
        if leaf == "weight_g_idx":
            raise ValueError(f"checkpoint: {name}: activation-ordered groups (actorder 'group') are not supported")
        if leaf == "weight_shape" and quant.scheme == "W8A16":
            continue
        if leaf == "weight_packed" and quant.scheme == "W8A16":
            shape = sd.get(f"{prefix}.weight_shape")
            if shape is None:
                raise ValueError(f"checkpoint: {prefix}.weight_shape is missing (needed by {name})")
            rows, cols = (int(v) for v in shape.tolist())
            if t.dtype != torch.int32 or tuple(t.shape) != (rows, -(-cols // 4)):
                raise ValueError(f"checkpoint: {name} is {t.dtype} {tuple(t.shape)}, but weight_shape "
                                 f"({rows}, {cols}) packs into int32 ({rows}, {-(-cols // 4)})")  # fmt: skip
            name, t = f"{prefix}.weight", unpack_int8(t, (rows, cols))  # [out, in] int8
        out[name] = t
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in QUANTIZED_PROJS:
            continue
        if quant.scheme == "W8A16" and f"{prefix}.weight_packed" not in sd:
            raise ValueError(f"checkpoint: {name} is stored as it is, but format 'pack-quantized' needs "
                             f"{prefix}.weight_packed and {prefix}.weight_shape")  # fmt: skip
        if t.dtype != torch.int8:
            raise ValueError(f"checkpoint: {name} is {t.dtype}, but quantization_config says int8 weights")
        needed = ["weight_scale"] + (["input_scale"] if quant.static_input else [])
        for leaf in needed:
            if f"{prefix}.{leaf}" not in sd:
                raise ValueError(f"checkpoint: {prefix}.{leaf} is missing (needed by {prefix}.weight, int8)")
    return out
