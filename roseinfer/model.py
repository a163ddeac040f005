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

from roseinfer.activations import get_activation
from roseinfer.attention import AttentionMetadata

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's (K pool, V pool), each [num_blocks, block_size, H, D]


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # the context length
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = 50256  # None: never stop at EOS
    n_inner: int | None = None  # the MLP's width; None = 4 * n_embd
    activation_function: str = "gelu_new"  # a name from roseinfer/activations.py
    scale_attn_weights: bool = True  # scale q·kᵀ by 1/√head_dim
    scale_attn_by_inverse_layer_idx: bool = False  # ... and by 1/(layer index + 1)
    tie_word_embeddings: bool = True  # lm_head = wteᵀ; False: a separate lm_head.weight

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, hf: dict) -> GPT2Config:
        """Build from a Hugging Face `config.json` dict; roseinfer/hf_config.py checks every field
        that changes the math and refuses what we do not implement."""
        from roseinfer.hf_config import config_kwargs_from_hf

        return cls(**config_kwargs_from_hf(hf))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int = 0):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        # softmax(q·kᵀ · scale) v: scale is 1/√D in GPT-2; two config switches change it (as in transformers)
        self.scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, kv_cache: KV | None = None, meta: AttentionMetadata | None = None):
        """x [B, T, C] -> [B, T, C].

        Without a cache this is plain causal attention (the naive path). With the paged cache
        (`kv_cache` = this layer's K and V pools [num_blocks, block_size, H, D]) the new
        tokens' K/V are first written into their slots (`meta.slot_mapping`), then:
          prefill (B = 1, the whole prompt): attend within the prompt's own q/k/v;
          decode (T = 1 per sequence): read every earlier token through the block table.
        """
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, self.head_dim) for t in (q, k, v))  # [B, T, H, D]
        if kv_cache is not None:
            meta.backend.write_kv(k.reshape(B * T, self.n_head, self.head_dim),
                                  v.reshape(B * T, self.n_head, self.head_dim),
                                  kv_cache[0], kv_cache[1], meta.slot_mapping)  # fmt: skip
        if kv_cache is None or meta.is_prefill:
            # softmax(q kᵀ · scale) v over [B, H, T, D], where token t may only look at tokens ≤ t
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=self.scale)  # fmt: skip
            y = y.transpose(1, 2)  # [B, T, H, D]
        else:
            y = meta.backend.paged_attention(q[:, 0], kv_cache[0], kv_cache[1], meta.block_tables,
                                             meta.context_lens, self.scale)[:, None]  # fmt: skip
        return self.c_proj(y.reshape(B, T, C))  # merge heads back: [B, T, C]


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)
        self.act = get_activation(cfg.activation_function)  # gelu_new: GELU with the tanh approximation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [B, T, C] -> [B, T, inner] -> [B, T, C]


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KV | None = None, meta: AttentionMetadata | None = None):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embeddings
                wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),  # learned position embeddings
                h=nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
            )
        )
        # the LM head: wteᵀ when tied (GPT-2), else its own [V, C] weight (tie_word_embeddings=false)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_caches: list[KV] | None = None,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]. Positions default to 0..T-1.

        `kv_caches` (one (K, V) pool per layer) and `meta` switch on the paged KV cache.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(position_ids)  # [B, T, C]
        for i, block in enumerate(tr.h):
            x = block(x, None if kv_caches is None else kv_caches[i], meta)
        x = tr.ln_f(x)
        head = tr.wte.weight if self.lm_head is None else self.lm_head.weight  # [V, C]
        return F.linear(x, head)  # LM head: [B, T, C] @ [C, V] -> [B, T, V]
