"""The Llama family (Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2), written out in one page.

    tokens ──► embed_tokens ──► [ DecoderLayer ] × L ──► norm ──► lm_head ──► logits
                                                           (no position embedding: RoPE, in attention)
    DecoderLayer:  x = x + self_attn(input_layernorm(x), positions)     RMSNorm, then attention with RoPE
                   x = x + mlp(post_attention_layernorm(x))             RMSNorm, then SwiGLU
                   (written as vLLM does: each norm takes the block's output and the residual stream, adds
                   them and normalises the sum, one fused op: layernorm.py; the rotation and SiLU·up too;
                   where the backend's K/V layout is write_kv_flat's, the rotation's pass also writes K and V)

What differs from GPT-2 (gpt2.py), and where an inference engine feels it:

    RMSNorm        x / √(mean(x²) + ε) · w: no mean subtracted, no bias
    RoPE           q and k rotated by their positions in every layer (rotary_embedding.py); K is
                   rotated *before* it is written to the paged cache, so the cache holds final keys
    GQA            num_key_value_heads ≤ num_attention_heads: G = H / Hkv query heads share one K/V
                   head, so the KV cache holds Hkv heads per token, not H (G× smaller)
    SwiGLU         down(silu(gate(x)) · up(x)): three matrices, the gate a learned mask
    head           untied lm_head (Llama 3 8B) or tied to embed_tokens (Llama 3.2 1B, SmolLM2, Qwen small)
    Qwen2 / Qwen3  a bias on q/k/v (Qwen2); an RMSNorm over each q and k head before RoPE (Qwen3)

As in vLLM, q, k and v come out of one fused `qkv_proj` and gate and up out of one `gate_up_proj`:
one GEMM instead of three (two). `convert_state_dict` builds them from the checkpoint's separate
`q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj`, cutting each into this rank's heads first.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from roseinfer.attention import AttentionMetadata
from roseinfer.attention.sdpa import write_kv_flat
from roseinfer.model_executor.activations import SiluAndMul
from roseinfer.model_executor.dense_linear import DenseWeight
from roseinfer.model_executor.layernorm import RMSNorm
from roseinfer.model_executor.llama_config import LlamaConfig
from roseinfer.model_executor.onednn_linear import pack_linear_layers, pack_weight, packed_linear
from roseinfer.model_executor.parallel_layers import ColumnParallelLinear, RowParallelLinear
from roseinfer.model_executor.quantization.compressed_tensors import use_int8_linears
from roseinfer.model_executor.rotary_embedding import ApplyRotary, RotaryEmbedding

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's (K pool, V pool), each [num_blocks, block_size, Hkv, D]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_size: int = 1):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size
        self.head_dim, self.scale = cfg.head_dim, cfg.head_dim**-0.5
        self.q_size, self.kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim  # this rank's
        width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, width, tp_size, bias=cfg.qkv_bias)  # [q | k | v]
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp_size,
                                        bias=cfg.o_bias)  # fmt: skip
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None  # Qwen3
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = ApplyRotary(is_neox=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KV | None = None,
                meta: AttentionMetadata | None = None) -> torch.Tensor:  # fmt: skip
        """paged  x [N, C]: a step's new tokens, flattened. q, k rotated with their positions (`rope`:
                  their cos, sin), K/V written to their slots, then attention through the block tables.
        dense  x [B, T, C], no cache: causal attention over the T tokens (the naive loop, tests)."""
        lead = x.shape[:-1]  # (N,) or (B, T)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(*lead, self.n_head, self.head_dim)  # [N, H, D]
        k = k.view(*lead, self.n_kv_head, self.head_dim)  # [N, Hkv, D]
        v = v.view(*lead, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is None:
            q, k = self.rotary(q, k, *rope)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D], [B, Hkv, T, D]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(*lead, self.q_size))
        if meta.backend.write_kv is write_kv_flat and kv_cache[0].dtype == k.dtype:  # rotation writes K (final), V
            q, k = self.rotary.forward_write_kv(q, k, v, *rope, *kv_cache, meta.slot_mapping)
        else:
            q, k = self.rotary(q, k, *rope)
            meta.backend.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)  # rotated K: final
        y = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [N, H, D]
        return self.o_proj(y.reshape(*lead, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), gate and up in one GEMM."""

    def __init__(self, cfg: LlamaConfig, tp_size: int = 1):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, tp_size, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp_size, bias=cfg.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [N, 2I] -> [N, I] -> [N, C] (this rank's I)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_size: int = 1):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp_size)

    def forward(self, x, residual, rope, kv_cache: KV | None = None, meta: AttentionMetadata | None = None):
        """x: the last block's output, residual: the stream before it (None in the first layer) -> both, for
        the next layer. Each norm adds the block's output to the residual stream and normalises the sum."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The same interface as GPT2: `forward(input_ids)` (dense), `forward_paged(...)` and `compute_logits`."""

    def __init__(self, cfg: LlamaConfig, tp_size: int = 1):
        super().__init__()
        self.config, self.tp_size = cfg, tp_size
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                layers=nn.ModuleList(LlamaDecoderLayer(cfg, tp_size) for _ in range(cfg.num_hidden_layers)),
                norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_packed: torch.Tensor | DenseWeight | None = None
        if cfg.quantization is not None:  # a W8A8 or W8A16 checkpoint: the decoder's linears hold int8 weights
            use_int8_linears(self.model, cfg.quantization, tp_size)

    def pack_linears(self, backend: str = "onednn") -> None:
        """Pack every linear layer's weight and the LM head's once for `backend`'s GEMM: 'dense' (dense_linear.py)
        or 'onednn' (onednn_linear.py)."""
        pack_linear_layers(self.model, backend)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, C]
        self.head_packed = pack_weight(head, backend)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V], positions 0..T-1, no cache."""
        x = self.model.embed_tokens(input_ids)  # [B, T, C]
        rope = self.rotary_emb(torch.arange(input_ids.shape[1], device=input_ids.device), x.dtype)  # [T, 1, D]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope)  # cos, sin [T, 1, D] broadcast against q [B, T, H, D]
        return self.compute_logits(self.model.norm(x, residual)[0])

    def forward_paged(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KV], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One engine step: input_ids [N], positions [N] -> hidden states [N, C]. The step's cos/sin are
        computed once here and every layer rotates its q and k with them."""
        x = self.model.embed_tokens(input_ids)  # [N, C]
        rope = self.rotary_emb(positions, x.dtype)  # cos, sin [N, 1, D]
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., C] -> logits [..., V], through the LM head."""
        if self.head_packed is not None:
            return packed_linear(hidden, self.head_packed, None)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, C]
        return F.linear(hidden, head)

    @staticmethod
    def convert_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig, tp_rank: int = 0,
                           tp_size: int = 1) -> dict[str, torch.Tensor]:  # fmt: skip
        """A transformers checkpoint -> this module's names, for rank `tp_rank` of `tp_size`:
        q/k/v_proj -> qkv_proj (this rank's query heads, then its K/V heads), gate/up_proj -> gate_up_proj
        (this rank's slice of each), o_proj and down_proj cut by columns. Embeddings, norms and the head
        stay whole on every rank."""

        def rows(w: torch.Tensor) -> torch.Tensor:  # this rank's share of an [out, in] weight's rows
            return w.chunk(tp_size, dim=0)[tp_rank]

        out, fused = {}, {}
        for name, w in sd.items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the head is embed_tokens
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old checkpoints saved; computed from the config instead
            prefix, _, leaf = name.rpartition(".")  # "model.layers.3.self_attn.q_proj", "weight"
            module, _, proj = prefix.rpartition(".")
            if proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                fused[(module, proj, leaf)] = rows(w)
            elif proj in ("o_proj", "down_proj") and leaf == "weight":
                out[name] = w.chunk(tp_size, dim=1)[tp_rank].contiguous()  # columns: this rank's inputs
            else:
                out[name] = w
        for (module, proj, leaf), _ in list(fused.items()):
            if proj == "q_proj":
                parts = [fused.get((module, p, leaf)) for p in ("q_proj", "k_proj", "v_proj")]
                target = f"{module}.qkv_proj.{leaf}"
            elif proj == "gate_proj":
                parts = [fused.get((module, p, leaf)) for p in ("gate_proj", "up_proj")]
                target = f"{module}.gate_up_proj.{leaf}"
            else:
                continue
            if any(p is None for p in parts):
                raise ValueError(f"checkpoint: {module} has {proj}.{leaf} but not all of the projections fused with it")
            if leaf == "input_scale":  # static per-tensor scales of q, k, v (gate, up): one for the fused input
                out[target] = torch.stack(parts).amax(dim=0)  # [1], the largest: no value of x clips
            else:
                out[target] = torch.cat(parts, dim=0).contiguous()  # weight, bias, weight_scale: by rows
        return out
