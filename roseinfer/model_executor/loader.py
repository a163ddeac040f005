"""Find a model (bundled, local directory or Hugging Face Hub id) and load its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from roseinfer.model_executor.custom_op import set_custom_op_impl
from roseinfer.model_executor.onednn_linear import resolve_linear_backend
from roseinfer.model_executor.quantization.compressed_tensors import (
    check_quantized_state_dict,
    process_weights_after_loading,
)
from roseinfer.model_executor.registry import ModelConfigType, architecture_of, get_model_spec, model_class_of

DEFAULT_MODEL = str(Path(__file__).parent.parent / "models" / "tiny-shakespeare")

# what we fetch from the Hub: the config, the tokenizer in every form we read, and the weights
# (model.safetensors; pytorch_model.bin only for repos without it, so we never download both)
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer.tiktoken", "vocab.json", "merges.txt",
              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]  # fmt: skip


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """None -> the bundled model; an existing directory -> itself; else a Hub id to download."""
    if model is None:
        return Path(DEFAULT_MODEL)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a directory, a Hub id or None, got {model!r} ({type(model).__name__})")
    if str(model).strip() == "":
        raise ValueError("model is an empty string: give a directory, a Hub id, or None for the bundled model")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        return path
    looks_like_path = str(model).startswith((".", "/", "~")) or str(model).count("/") > 1 or path.exists()
    if looks_like_path:
        raise FileNotFoundError(f"model path {str(model)!r} does not exist (or is not a directory)")
    return _download_from_hub(str(model))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, "model*.safetensors*"]))
        if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
            path = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model.bin"]))
        return path
    except Exception as e:  # offline, unknown repo, gated repo ...
        raise OSError(
            f"could not load model {repo_id!r}: it is not a local directory and downloading it "
            f"from the Hugging Face Hub failed ({type(e).__name__}: {e}). Pass a local model "
            f"directory, or run once with internet access to fill the Hub cache."
        ) from e


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read the weights: model.safetensors, or the shards model.safetensors.index.json lists (big checkpoints
    are cut into several files, and the index maps every tensor name to its file), or pytorch_model.bin."""
    from safetensors.torch import load_file

    if (model_dir / "model.safetensors").exists():
        return load_file(model_dir / "model.safetensors")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no weight_map (tensor name -> shard file)")
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (model_dir / shard).exists():
                raise FileNotFoundError(f"shard {shard!r}, named in {str(index)!r}, is missing from {str(model_dir)!r}")
            sd.update(load_file(model_dir / shard))
        missing = sorted(set(weight_map) - set(sd))
        if missing:
            raise ValueError(f"{str(index)!r} maps {missing[:3]} to shards that do not hold them")
        return sd
    if (model_dir / "pytorch_model.bin").exists():
        return torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in "
                            f"{str(model_dir)!r}")  # fmt: skip


def read_model_config(model_dir: Path) -> ModelConfigType:
    """config.json, read by its architecture's class (registry.py: every field checked), with the EOS ids of
    generation_config.json when that file has them: transformers' generate stops on those."""
    hf = json.loads((model_dir / "config.json").read_text())
    hf = {**hf, "architectures": [architecture_of(hf)]}
    generation = model_dir / "generation_config.json"
    if generation.exists():
        hf = {**hf, "eos_token_id": json.loads(generation.read_text()).get("eos_token_id")}
    return get_model_spec(hf).read_config(hf)


def load_model(model_dir: Path, cfg: ModelConfigType, device: torch.device, dtype: torch.dtype, tp_rank: int = 0,
               tp_size: int = 1, linear_backend: str = "auto", custom_ops: str = "auto") -> nn.Module:  # fmt: skip
    """The model in eval mode on `device` in `dtype` (the checkpoint's own dtype does not matter: fp32, fp16
    and bf16 weights are all cast). With `tp_size` > 1, only rank `tp_rank`'s shard of the weights (see
    roseinfer/model_executor/parallel_layers.py). `linear_backend` 'auto', 'dense' or 'onednn' on a CPU: the
    linear layers' weights are also packed for that GEMM (dense_linear.py, onednn_linear.py). `custom_ops`: how
    the model's small ops (RMSNorm, RoPE, SiLU·up) run, "auto" | "native" | "compile" (custom_op.py)."""
    linear_backend = resolve_linear_backend(linear_backend, device, dtype)
    model_class = model_class_of(cfg)
    sd = load_state_dict(model_dir)
    quant = getattr(cfg, "quantization", None)
    if quant is not None:  # int8 weights (W8A16: unpacked) and their scales checked by name
        sd = check_quantized_state_dict(sd, quant)
    ours = model_class.convert_state_dict(sd, cfg, tp_rank, tp_size)
    net = model_class(cfg, tp_size)
    expected = net.state_dict()
    wrong = [f"{n} {tuple(w.shape)} (expected {tuple(expected[n].shape)})"
             for n, w in ours.items() if n in expected and w.shape != expected[n].shape]  # fmt: skip
    if wrong:
        raise ValueError(f"checkpoint in {str(model_dir)!r} does not match its config.json: {wrong[:4]}")
    missing, unexpected = net.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint in {str(model_dir)!r} does not fit {model_class.__name__}: "
                         f"missing={missing} unexpected={unexpected}")  # fmt: skip
    net = net.to(device=device, dtype=dtype).eval()
    if quant is not None:
        process_weights_after_loading(net)
    if linear_backend in ("dense", "onednn"):
        net.pack_linears(linear_backend)
    set_custom_op_impl(net, custom_ops)
    return net
