"""The inference engine: turn a prompt into a continuation, one token at a time.

Stage 01 is the naive loop. Every step feeds the *whole* sequence so far through the
model and keeps only the last position's logits:

    step 1:  [p0 p1 p2]          -> t3
    step 2:  [p0 p1 p2 t3]       -> t4
    step 3:  [p0 p1 p2 t3 t4]    -> t5      (work grows with length: O(n²) overall)
"""

from __future__ import annotations

import os

import torch

from roseinfer.loader import load_model, pick_device, pick_dtype
from roseinfer.tokenizer import Tokenizer


class InferenceEngine:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
    ):
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.model, self.model_dir = load_model(model, self.device, self.dtype)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir, self.config.vocab_size)
        self.eos_token_id = self.tokenizer.eos_token_id

    # ---- input checks -------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenize (or check) a prompt and make sure there is room to generate."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty: give at least one character")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty: give at least one token id")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        else:
            raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if len(ids) >= self.config.n_positions:
            raise ValueError(
                f"prompt is {len(ids)} tokens long but the model's context is {self.config.n_positions} "
                f"tokens; it must be shorter to leave room for at least one new token"
            )
        return ids

    # ---- generation ---------------------------------------------------------------
    @torch.inference_mode()
    def generate_ids(
        self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None
    ) -> list[int]:
        """Return the new token ids (an EOS, if produced, is the last one)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        prompt_ids = self.encode_prompt(prompt_ids)
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        new: list[int] = []
        while len(new) < max_new_tokens and ids.shape[1] < self.config.n_positions:
            logits = self.model(ids)[:, -1, :].float()  # the whole sequence again; keep the last row: [1, V]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)  # greedy: [1, 1]
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=gen)  # [1, 1]
            ids = torch.cat([ids, next_id], dim=1)
            new.append(next_id.item())
            if new[-1] == self.eos_token_id:
                break
        return new

    def generate(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None) -> str:
        """Return the continuation of `prompt` as text (without the prompt and without EOS)."""
        new = self.generate_ids(self.encode_prompt(prompt), max_new_tokens, temperature, seed)
        if new and new[-1] == self.eos_token_id:
            new = new[:-1]
        return self.tokenizer.decode(new)
