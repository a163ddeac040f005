"""Small random checkpoints in Hugging Face's format, for tests and for examples that need a tiny model
(examples/verify_paged_attention.py on a CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from roseinfer import DEFAULT_MODEL


def make_random_checkpoint(
    path: Path, seed: int = 0, safetensors: bool = True, tokenizer: bool = True, **overrides
) -> Path:
    """Save a small random GPT-2 in HF format to `path`, plus the bundled tokenizer.tiktoken
    unless `tokenizer=False`. `overrides` are transformers.GPT2Config fields."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    kw = dict(vocab_size=4096, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=4095, eos_token_id=4095)
    kw.update(overrides)
    model = GPT2LMHeadModel(GPT2Config(**kw)).eval()
    path.mkdir(parents=True, exist_ok=True)
    if safetensors:
        model.save_pretrained(path)
    else:  # the old format, as the original `gpt2` repo: GPT2Model keys + a causal-mask buffer
        model.config.save_pretrained(path)
        sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
        sd["h.0.attn.bias"] = torch.tril(torch.ones(kw["n_positions"], kw["n_positions"]))[None, None]
        torch.save(sd, path / "pytorch_model.bin")
    if tokenizer:
        shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.tiktoken", path / "tokenizer.tiktoken")
    return path
