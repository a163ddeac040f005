"""Write a compressed-tensors int8 copy (W8A8, or weight-only W8A16) of a Llama-family or GPT-2 checkpoint (fp32,
fp16 or bf16).

    python scripts/quantize_w8a8.py MODEL_DIR OUT_DIR [--static]                      W8A8 (the default)
    python scripts/quantize_w8a8.py MODEL_DIR OUT_DIR --scheme W8A16 [--group-size G]  W8A16

Every linear layer of the decoder (q/k/v/o_proj, gate/up/down_proj; GPT-2's c_attn, c_proj, c_fc, c_proj) is
rounded to nearest int8 per output channel (int8.py's `quantize_weight`), with `weight_scale` fp32 [out, 1];
the embeddings, norms and head are copied as they are, and the head is listed in `ignore`.

W8A8 (format "int-quantized"): `weight` int8 [out, in]. Activations are quantized at run time, per token
(`dynamic`), or with `--static` by one `input_scale` per layer, measured here as max|x| / 127 over a
calibration text run through the float model.
W8A16 (format "pack-quantized", no input_activations): `weight_packed` int32 [out, in / 4] + `weight_shape`
[2], as llm-compressor packs int weights of 8 bits and fewer (compressed_tensors.py's `pack_int8`); with
`--group-size G` one scale per G inputs, weight_scale [out, in / G] (llm-compressor's W8A16 preset since
compressed-tensors 0.16 uses G = 128; before, per channel).

GPT-2 stores its linears as Conv1D, weight [in, out]. The copy keeps the layout vLLM's GPT-2 loader reads (it
transposes each c_attn/c_proj/c_fc tensor named `.weight`, nothing else): W8A8's int8 `weight` is written [in, out]
like the float one; `weight_scale`, `input_scale` and W8A16's `weight_packed` / `weight_shape` as for a Linear.

config.json gets the `quantization_config` that llm-compressor writes for the scheme, so the directory loads
in roseinfer and in vLLM. Tokenizer and generation files are copied. Round-to-nearest with no calibration of
the weights is the simplest method there is (llm-compressor's SmoothQuant/GPTQ recipes lose less accuracy).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from roseinfer.model_executor.loader import load_state_dict
from roseinfer.model_executor.quantization.compressed_tensors import FORMATS, QUANTIZED_PROJS, pack_int8
from roseinfer.model_executor.quantization.int8 import INT8_MAX, quantize_weight
from roseinfer.model_executor.registry import architecture_of

COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.tiktoken", "vocab.json",
          "merges.txt", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")  # fmt: skip
CALIBRATION = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
               "and arrows of outrageous fortune, or to take arms against a sea of troubles.")  # fmt: skip


def quantization_config(static: bool, scheme: str = "W8A8", group_size: int | None = None) -> dict:
    """config.json's `quantization_config` for W8A8 or W8A16 int8, as llm-compressor writes it."""
    act = dict(num_bits=8, type="int", symmetric=True, group_size=None, strategy="tensor" if static else "token",
               dynamic=not static, actorder=None, block_structure=None, observer="minmax" if static else None,
               observer_kwargs={})  # fmt: skip
    act = None if scheme == "W8A16" else act  # weight only: no input_activations
    weights = dict(num_bits=8, type="int", symmetric=True, group_size=group_size, dynamic=False, actorder=None,
                   strategy="group" if group_size else "channel", block_structure=None, observer="minmax",
                   observer_kwargs={})  # fmt: skip
    fmt = FORMATS[scheme]
    return dict(quant_method="compressed-tensors", format=fmt, quantization_status="compressed",
                config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=act,
                                               output_activations=None, format=fmt)},
                ignore=["lm_head"], kv_cache_scheme=None, sparsity_config={}, version="0.17.0")  # fmt: skip


DECODER_LAYER = re.compile(r"(^|\.)(layers|h)\.\d+\.")  # model.layers.3. (Llama), transformer.h.3. or h.3. (GPT-2)


def is_quantized(name: str) -> bool:
    """Is `name` the weight of a decoder layer's linear (the layers that become int8)?"""
    prefix, _, leaf = name.rpartition(".")
    return leaf == "weight" and DECODER_LAYER.search(name) is not None and prefix.rpartition(".")[2] in QUANTIZED_PROJS


def input_scales(model_dir: Path, text: str) -> dict[str, torch.Tensor]:
    """Run the float model (roseinfer's dense forward) over `text`; for every decoder linear, the scale
    max|x| / 127 of its input, under the checkpoint's names (q, k and v share qkv_proj's input). roseinfer's
    module names are the checkpoint's (GPT-2: with the `transformer.` prefix, which both loaders add)."""
    from roseinfer.model_executor.loader import load_model, read_model_config
    from roseinfer.tokenizer.tokenizer import Tokenizer

    cfg = read_model_config(model_dir)
    model = load_model(model_dir, cfg, torch.device("cpu"), torch.float32, linear_backend="aten")
    tok = Tokenizer.from_model_dir(model_dir)  # the model's own tokenizer, whichever kind it is
    ids = torch.tensor([tok.encode(text)[: cfg.max_position_embeddings]])  # [1, T]
    amax: dict[str, torch.Tensor] = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and DECODER_LAYER.search(n)]
    hooks = [m.register_forward_hook(lambda m, args, out, n=n: amax.__setitem__(n, args[0].abs().amax()))
             for n, m in linears]  # fmt: skip
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    scales = {}
    for name, a in amax.items():
        module, _, proj = name.rpartition(".")
        for p in fused.get(proj, (proj,)):
            scales[f"{module}.{p}.input_scale"] = (a.clamp(min=1e-8) / INT8_MAX).reshape(1).float()  # [1]
    return scales


def quantize_checkpoint(model_dir: Path, out_dir: Path, static: bool = False, text: str = CALIBRATION,
                        scheme: str = "W8A8", group_size: int | None = None) -> int:  # fmt: skip
    """Write the `scheme` copy of `model_dir` into `out_dir`; returns how many linear layers were quantized."""
    if scheme not in FORMATS or (scheme == "W8A16" and static) or (scheme == "W8A8" and group_size):
        raise ValueError(f"scheme {scheme!r}: W8A8 (optionally static) or W8A16 (optionally with a group size)")
    from safetensors.torch import save_file

    hf = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in hf:
        raise ValueError(f"{str(model_dir)!r} is already quantized ({hf['quantization_config'].get('quant_method')})")
    conv1d = architecture_of(hf) == "GPT2LMHeadModel"  # GPT-2: the float weights are [in, out]
    sd = load_state_dict(model_dir)
    out: dict[str, torch.Tensor] = {}
    n = 0
    tied = hf.get("tie_word_embeddings", conv1d)  # transformers' default: True for GPT-2, False for Llama
    for name, w in sd.items():
        if name == "lm_head.weight" and tied:
            continue  # the embedding itself (old GPT-2 .bin files hold both, sharing memory); saved once, as wte
        if conv1d and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # old GPT-2 files name h.0...; input_scales() names transformer.h.0...
        if is_quantized(name):
            w = w.t() if conv1d else w  # [out, in]
            w_q, scale = quantize_weight(w, group_size)
            prefix = name[: -len("weight")]
            out[prefix + "weight_scale"] = scale.reshape(w.shape[0], -1).contiguous()  # [out, 1] or [out, in / G]
            if scheme == "W8A16":
                out[prefix + "weight_packed"] = pack_int8(w_q)  # [out, ceil(in / 4)] int32, for GPT-2 too
                out[prefix + "weight_shape"] = torch.tensor(w.shape)  # [2] int64: (out, in)
            else:
                out[name] = w_q.t().contiguous() if conv1d else w_q  # [in, out] (GPT-2's Conv1D) or [out, in] int8
            n += 1
        else:
            out[name] = w.contiguous()
    if static:
        out.update(input_scales(model_dir, text))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    hf["quantization_config"] = quantization_config(static, scheme, group_size)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for f in COPIED:
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, out_dir / f)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="a Llama-family or GPT-2 checkpoint directory (fp32, fp16 or bf16)")
    ap.add_argument("out_dir", type=Path, help="where to write the int8 copy")
    ap.add_argument("--scheme", choices=sorted(FORMATS), default="W8A8",
                    help="W8A8: int8 weights and activations; W8A16: int8 weights only (default: W8A8)")  # fmt: skip
    ap.add_argument("--static", action="store_true", help="W8A8: static per-tensor input scales from a calibration")
    ap.add_argument("--group-size", type=int, help="W8A16: one weight scale per this many inputs (default: per row)")
    ap.add_argument("--calibration-text", type=Path, help="a text file for --static (default: a built-in line)")
    args = ap.parse_args(argv)
    text = args.calibration_text.read_text() if args.calibration_text else CALIBRATION
    if args.scheme == "W8A16" and args.static or args.scheme == "W8A8" and args.group_size:
        ap.error("--static goes with W8A8 only, --group-size with W8A16 only")
    n = quantize_checkpoint(args.model_dir, args.out_dir, args.static, text, args.scheme, args.group_size)
    kind = "float" if args.scheme == "W8A16" else "static int8" if args.static else "dynamic int8"
    print(f"{n} linear layers quantized to int8 ({args.scheme}, {kind} activations) -> {args.out_dir}")
    return 0
