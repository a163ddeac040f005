"""GPT-2, written out in one page (in the spirit of nanoGPT).

    tokens ──► wte + wpe ──► [ Block ] × n_layer ──► ln_f ──► lm_head (= wteᵀ) ──► logits

    Block:  x = x + attn(ln_1(x))      pre-LayerNorm, causal self-attention
            x = x + mlp(ln_2(x))       Linear ─ gelu_new ─ Linear

Parameter names follow Hugging Face's checkpoint (`transformer.h.0.attn.c_attn.weight`),
so loading is a rename-free copy (see `roseinfer/loader.py`). HF stores its linear layers
as `Conv1D` with weight `[in, out]`; we use `nn.Linear` (`[out, in]`), so the loader
transposes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's (keys, values), each [B, H, T, D]


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # the context length
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int = 50256

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, hf: dict) -> GPT2Config:
        """Build from a Hugging Face `config.json` dict (only GPT-2 is supported)."""
        if hf.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"roseinfer runs GPT-2 models, got model_type={hf.get('model_type')!r}")
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation_function {act!r} (GPT-2 uses gelu_new)")
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            n_positions=hf["n_positions"],
            n_embd=hf["n_embd"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            eos_token_id=hf["vocab_size"] - 1 if eos is None else eos,
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self, x: torch.Tensor, past: KV | None = None, attn_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KV]:
        """x [B, T, C]; `past` holds the K/V of earlier tokens ([B, H, T_past, D] each).
        `attn_mask` [B, T_past + 1] (decode only) is True where a key may be attended to:
        in a padded batch it hides each row's padding.

        Returns the output [B, T, C] and this layer's K/V including the new tokens.
        """
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × [B, T, C]
        # split C into heads: [B, T, C] -> [B, H, T, D]
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if past is not None:
            # Decode: one new token attends to every cached token and to itself, so no causal mask is needed.
            assert T == 1, "with a KV cache, feed one token at a time"
            k = torch.cat([past[0], k], dim=2)  # [B, H, T_past + 1, D]
            v = torch.cat([past[1], v], dim=2)
        # softmax(q kᵀ / √D) v, where token t may only look at tokens ≤ t
        mask = None if attn_mask is None else attn_mask[:, None, None, :]  # [B, 1, 1, T_past + 1]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past is None)  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, C)  # merge heads back: [B, T, C]
        return self.c_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gelu_new is GELU with the tanh approximation
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, past: KV | None = None, attn_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KV]:
        a, kv = self.attn(self.ln_1(x), past, attn_mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embeddings
                wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),  # learned position embeddings
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
            )
        )

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, past: list[KV] | None = None
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]. Positions default to 0..T-1."""
        return self._run(input_ids, position_ids, past)[0]

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """Run the whole prompt once. input_ids [B, T] -> (logits [B, T, V], per-layer K/V [B, H, T, D])."""
        return self._run(input_ids, None, None)

    def decode_step(
        self, token_ids: torch.Tensor, position_ids: torch.Tensor, past: list[KV], attn_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """One new token per sequence: token_ids [B], position_ids [B] -> (logits [B, V], K/V grown by one).

        In a batch of different lengths, `past` is padded and `attn_mask` [B, T_past + 1] marks real keys.
        """
        logits, kv = self._run(token_ids[:, None], position_ids[:, None], past, attn_mask)
        return logits[:, -1], kv

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: list[KV] | None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(position_ids)  # [B, T, C]
        new_kv = []
        for i, block in enumerate(tr.h):
            x, kv = block(x, None if past is None else past[i], attn_mask)
            new_kv.append(kv)
        x = tr.ln_f(x)
        return F.linear(x, tr.wte.weight), new_kv  # tied LM head: [B, T, C] @ [C, V] -> [B, T, V]
