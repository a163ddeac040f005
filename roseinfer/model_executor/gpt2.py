"""GPT-2, written out in one page (in the spirit of nanoGPT).

    tokens ──► wte + wpe ──► [ Block ] × n_layer ──► ln_f ──► lm_head (= wteᵀ) ──► logits

    Block:  x = x + attn(ln_1(x))      pre-LayerNorm, causal self-attention
            x = x + mlp(ln_2(x))       Linear ─ gelu_new ─ Linear

Parameter names follow Hugging Face's checkpoint (`transformer.h.0.attn.c_attn.weight`),
so loading is a rename-free copy (see `roseinfer/model_executor/loader.py`). HF stores its linear layers
as `Conv1D` with weight `[in, out]`; we use `nn.Linear` (`[out, in]`), so the loader
transposes them.

A compressed-tensors checkpoint (W8A8 or W8A16, as for the Llama family) swaps the four linears of every block
for int8 layers (quantization/int8_linear.py); embeddings, LayerNorms and the LM head stay float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from roseinfer.attention import AttentionMetadata
from roseinfer.model_executor.activations import NewGELU, gelu_tanh, get_activation
from roseinfer.model_executor.dense_linear import DenseWeight
from roseinfer.model_executor.onednn_linear import pack_linear_layers, pack_weight, packed_linear
from roseinfer.model_executor.parallel_layers import ColumnParallelLinear, RowParallelLinear, shard_state_dict
from roseinfer.model_executor.quantization.compressed_tensors import Int8QuantConfig, use_int8_linears

# Hugging Face's GPT-2 stores these four as Conv1D ([in, out]); nn.Linear wants [out, in].
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
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
    activation_function: str = "gelu_new"  # a name from roseinfer/model_executor/activations.py
    scale_attn_weights: bool = True  # scale q·kᵀ by 1/√head_dim
    scale_attn_by_inverse_layer_idx: bool = False  # ... and by 1/(layer index + 1)
    tie_word_embeddings: bool = True  # lm_head = wteᵀ; False: a separate lm_head.weight
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence (default: just eos_token_id)
    quantization: Int8QuantConfig | None = None  # None: float weights; else every block's linears int8

    def __post_init__(self) -> None:
        if not self.eos_token_ids and self.eos_token_id is not None:
            self.eos_token_ids = (self.eos_token_id,)

    # the engine's view of any model's config (registry.py), under transformers' common names
    head_dim = property(lambda self: self.n_embd // self.n_head)
    hidden_size = property(lambda self: self.n_embd)
    intermediate_size = property(lambda self: self.n_inner or 4 * self.n_embd)
    num_hidden_layers = property(lambda self: self.n_layer)
    num_attention_heads = property(lambda self: self.n_head)
    num_key_value_heads = property(lambda self: self.n_head)  # every head has its own K/V
    max_position_embeddings = property(lambda self: self.n_positions)
    sliding_window = None
    architecture = "GPT2LMHeadModel"  # the class config.json names (registry.py)

    @classmethod
    def from_hf(cls, hf: dict) -> GPT2Config:
        """Build from a Hugging Face `config.json` dict; roseinfer/model_executor/hf_config.py checks every field
        that changes the math and refuses what we do not implement."""
        from roseinfer.model_executor.hf_config import config_kwargs_from_hf

        return cls(**config_kwargs_from_hf(hf))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int = 0, tp_size: int = 1):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head // tp_size, cfg.head_dim  # this rank's heads
        self.width = self.n_head * self.head_dim  # n_embd / tp_size: q, k and v of this rank's heads
        # softmax(q·kᵀ · scale) v: scale is 1/√D in GPT-2; two config switches change it (as in transformers)
        self.scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)
        self.c_attn = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, tp_size)  # q, k, v in one matmul
        self.c_proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, tp_size)  # + an all-reduce when tp_size > 1

    def forward(self, x: torch.Tensor, kv_cache: KV | None = None, meta: AttentionMetadata | None = None):
        """Two shapes in, the same shape out.

        dense  x [B, T, C], no cache: plain causal attention over the T tokens (the naive loop).
        paged  x [N, C]: one step's new tokens of every request, flattened. Their K/V are first
               written into their slots of this layer's pool (`meta.slot_mapping`); then each
               request's queries attend to its whole context, read through its block table: what
               earlier steps wrote plus what this step just wrote.
        """
        if kv_cache is None:
            B, T, _ = x.shape
            q, k, v = self.c_attn(x).split(self.width, dim=2)  # 3 × [B, T, C]
            q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
            # softmax(q kᵀ · scale) v, where token t may only look at tokens ≤ t
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, H, T, D]
            return self.c_proj(y.transpose(1, 2).reshape(B, T, self.width))  # merge heads back: [B, T, C]
        N = x.shape[0]
        q, k, v = (t.view(N, self.n_head, self.head_dim) for t in self.c_attn(x).split(self.width, dim=1))  # [N, H, D]
        meta.backend.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        y = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [N, H, D]
        return self.c_proj(y.reshape(N, self.width))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, tp_size: int = 1):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = ColumnParallelLinear(cfg.n_embd, inner, tp_size)  # inner / tp_size features on this rank
        self.c_proj = RowParallelLinear(inner, cfg.n_embd, tp_size)  # + an all-reduce when tp_size > 1
        act = get_activation(cfg.activation_function)  # gelu_new: GELU with the tanh approximation
        self.act = NewGELU() if act is gelu_tanh else act  # its own op on a CPU (activations.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.c_fc, "packed", None) is not None and isinstance(self.act, NewGELU):  # int8 c_fc: none
            # oneDNN: c_fc and GELU in one call (the activation as the GEMM's post-op)
            return self.c_proj(packed_linear(x, self.c_fc.packed, self.c_fc.bias, gelu_tanh=True))
        return self.c_proj(self.act(self.c_fc(x)))  # [B, T, C] -> [B, T, inner] -> [B, T, C]


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int = 0, tp_size: int = 1):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer_idx, tp_size)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, tp_size)

    def forward(self, x: torch.Tensor, kv_cache: KV | None = None, meta: AttentionMetadata | None = None):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config, tp_size: int = 1):
        """`tp_size` > 1: this process holds one rank's shard of every block (parallel_layers.py);
        embeddings, LayerNorms and the LM head stay whole on every rank."""
        super().__init__()
        self.config, self.tp_size = cfg, tp_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embeddings
                wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),  # learned position embeddings
                h=nn.ModuleList(Block(cfg, i, tp_size) for i in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
            )
        )
        # the LM head: wteᵀ when tied (GPT-2), else its own [V, C] weight (tie_word_embeddings=false)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head_packed: torch.Tensor | DenseWeight | None = None  # the LM head packed (pack_linears)
        if cfg.quantization is not None:  # a W8A8 or W8A16 checkpoint: c_attn, c_proj, c_fc, c_proj hold int8
            use_int8_linears(self.transformer, cfg.quantization, tp_size)

    def pack_linears(self, backend: str = "onednn") -> None:
        """Pack every linear layer's weight and the LM head's once for `backend`'s GEMM: 'dense' (dense_linear.py)
        or 'onednn' (onednn_linear.py); the layers use the packed copies from then on. Call it after the weights
        are loaded and moved."""
        pack_linear_layers(self.transformer, backend)
        head = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight  # [V, C]
        self.head_packed = pack_weight(head, backend)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V], positions 0..T-1, no cache (the naive loop, tests)."""
        B, T = input_ids.shape
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(torch.arange(T, device=input_ids.device))  # [B, T, C]
        for block in tr.h:
            x = block(x)
        return self.compute_logits(tr.ln_f(x))

    def forward_paged(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KV], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One engine step: input_ids [N] and positions [N] of every request's new tokens, flattened
        (see `roseinfer/worker/model_runner.py`) -> hidden states [N, C]. The K/V land in `kv_caches`, one
        (K, V) pool per layer. Only the rows that need a next token go on to `compute_logits`."""
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(positions)  # [N, C]
        for block, kv_cache in zip(tr.h, kv_caches, strict=True):
            x = block(x, kv_cache, meta)
        return tr.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., C] -> logits [..., V], through the LM head."""
        if self.head_packed is not None:
            return packed_linear(hidden, self.head_packed, None)
        head = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight  # [V, C]
        return F.linear(hidden, head)

    @staticmethod
    def convert_state_dict(sd: dict[str, torch.Tensor], cfg: GPT2Config, tp_rank: int = 0,
                           tp_size: int = 1) -> dict[str, torch.Tensor]:  # fmt: skip
        """A transformers checkpoint -> this module's names (Conv1D weights transposed), rank `tp_rank`'s shard.

        Quantized, the rule is vLLM's: every `.weight` of c_attn/c_proj/c_fc as the checkpoint stores it is
        [in, out] (float, or W8A8's int8) and is transposed; the scales are [out, ...] already. W8A16 stores
        `weight_packed` [out, in / 4], never transposed, which the loader has unpacked to `.weight` [out, in]."""
        conv1d = cfg.quantization is None or cfg.quantization.scheme != "W8A16"  # are the .weights [in, out]?
        ours = {}
        for name, w in sd.items():
            name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            tied_head = name == "lm_head.weight" and cfg.tie_word_embeddings
            if name.endswith((".attn.bias", ".attn.masked_bias")) or tied_head:
                continue  # old causal-mask buffers; a tied LM head is wte (as in transformers)
            ours[name] = w.t() if conv1d and name.endswith(_CONV1D) else w
        return shard_state_dict(ours, cfg.n_head, tp_rank, tp_size)  # keep this rank's slices
