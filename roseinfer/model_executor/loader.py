"""Find a model (bundled, local directory or Hugging Face Hub id) and load its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from roseinfer.model_executor.gpt2 import GPT2, GPT2Config
from roseinfer.model_executor.onednn_linear import resolve_linear_backend
from roseinfer.model_executor.parallel_layers import shard_state_dict

DEFAULT_MODEL = str(Path(__file__).parent.parent / "models" / "tiny-shakespeare")

# Hugging Face's GPT-2 stores these four as Conv1D ([in, out]); nn.Linear wants [out, in].
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# what we fetch from the Hub: the config, the tokenizer in every form we read, and the weights
# (model.safetensors; pytorch_model.bin only for repos without it, so we never download both)
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer.tiktoken", "vocab.json", "merges.txt",
              "tokenizer.json", "tokenizer_config.json"]  # fmt: skip


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
        path = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, "model.safetensors"]))
        if not (path / "model.safetensors").exists():
            path = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model.bin"]))
        return path
    except Exception as e:  # offline, unknown repo, gated repo ...
        raise OSError(
            f"could not load model {repo_id!r}: it is not a local directory and downloading it "
            f"from the Hugging Face Hub failed ({type(e).__name__}: {e}). Pass a local model "
            f"directory, or run once with internet access to fill the Hub cache."
        ) from e


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read model.safetensors (preferred) or pytorch_model.bin."""
    if (model_dir / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(model_dir / "model.safetensors")
    if (model_dir / "pytorch_model.bin").exists():
        return torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {str(model_dir)!r}")


def read_model_config(model_dir: Path) -> GPT2Config:
    """config.json (checked field by field: roseinfer/model_executor/hf_config.py), with the EOS id of
    generation_config.json when that file exists: transformers' generate stops on that one."""
    hf = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    if generation.exists():
        hf = {**hf, "eos_token_id": json.loads(generation.read_text()).get("eos_token_id")}
    return GPT2Config.from_hf(hf)


def load_model(model_dir: Path, cfg: GPT2Config, device: torch.device, dtype: torch.dtype, tp_rank: int = 0,
               tp_size: int = 1, linear_backend: str = "auto") -> GPT2:  # fmt: skip
    """The model in eval mode on `device` in `dtype`. With `tp_size` > 1, only rank `tp_rank`'s shard of the
    weights (see roseinfer/model_executor/parallel_layers.py). `linear_backend` 'auto' or 'onednn' on a CPU:
    the linear layers' weights are also reordered for oneDNN (roseinfer/model_executor/onednn_linear.py)."""
    linear_backend = resolve_linear_backend(linear_backend, device, dtype)
    sd = load_state_dict(model_dir)
    ours = {}
    for name, w in sd.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # old causal-mask buffers; a tied LM head is wte (as in transformers)
        ours[name] = w.t() if name.endswith(_CONV1D) else w
    ours = shard_state_dict(ours, cfg.n_head, tp_rank, tp_size)  # keep this rank's slices
    net = GPT2(cfg, tp_size)
    expected = net.state_dict()
    wrong = [f"{n} {tuple(w.shape)} (expected {tuple(expected[n].shape)})"
             for n, w in ours.items() if n in expected and w.shape != expected[n].shape]  # fmt: skip
    if wrong:
        raise ValueError(f"checkpoint in {str(model_dir)!r} does not match its config.json: {wrong[:4]}")
    missing, unexpected = net.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {str(model_dir)!r} does not fit GPT-2: missing={missing} unexpected={unexpected}"
        )
    net = net.to(device=device, dtype=dtype).eval()
    if linear_backend == "onednn":
        net.pack_for_onednn()
    return net
