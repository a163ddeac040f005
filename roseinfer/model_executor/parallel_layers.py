"""Megatron-style tensor-parallel linear layers, and how a checkpoint is cut into per-rank shards.

A linear layer y = x Wᵀ + b (W is [out, in]) can be split across N ranks two ways:

    column-parallel: rank r holds out/N rows of W (and of b)     y_r = x W_rᵀ + b_r   a slice of y's columns
    row-parallel:    rank r holds in/N columns of W              y = Σ_r x_r W_rᵀ + b  every rank a partial sum

A column-parallel layer followed by a row-parallel one needs no communication in between: the first
leaves each rank with a slice of the features, exactly the slice of the input the second one holds.
Only the sum at the end crosses ranks: one all-reduce. GPT-2 has two such pairs per block:

    attention: c_attn (q, k, v) column-parallel by heads ─ attention on this rank's heads ─ c_proj row-parallel
    MLP:       c_fc column-parallel ─────────────────────── gelu ───────────────────────── c_proj row-parallel

and each row-parallel c_proj ends in an all-reduce: two per block.

With tp_size 1 both classes are plain `nn.Linear` layers: nothing else in the model changes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from roseinfer.model_executor.onednn_linear import packed_linear


class ColumnParallelLinear(nn.Linear):
    """This rank's out_features / tp_size outputs of an [out, in] layer; no communication."""

    packed: torch.Tensor | None = None  # the weight reordered for oneDNN (onednn_linear.py), on a CPU

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, bias: bool = True):
        super().__init__(in_features, out_features // tp_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return super().forward(x)


class RowParallelLinear(nn.Linear):
    """This rank's in_features / tp_size inputs of an [out, in] layer; the partial outputs of all ranks are
    summed by an all-reduce, and the bias (the same on every rank) is added once, after the sum."""

    packed: torch.Tensor | None = None  # the weight reordered for oneDNN (onednn_linear.py), on a CPU

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, bias: bool = True):
        super().__init__(in_features // tp_size, out_features, bias=bias)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x) if self.packed is None else packed_linear(x, self.packed, self.bias)
        # [N, out]: this rank's share of the sum
        y = F.linear(x, self.weight) if self.packed is None else packed_linear(x, self.packed, None)
        all_reduce(y)  # every rank now holds Σ over ranks: the whole layer's output
        return y if self.bias is None else y + self.bias


class CommStats:
    """Time spent in all-reduces (measured only when `enabled`: scripts/measure_tensor_parallel.py)."""

    enabled = False
    seconds = 0.0
    calls = 0
    bytes = 0


def all_reduce(t: torch.Tensor) -> None:
    """Sum `t` over the ranks of the default process group, in place."""
    if not CommStats.enabled:
        dist.all_reduce(t)
        return
    t0 = time.perf_counter()
    dist.all_reduce(t)
    CommStats.seconds += time.perf_counter() - t0
    CommStats.calls += 1
    CommStats.bytes += t.numel() * t.element_size()


def shard_state_dict(sd: dict[str, torch.Tensor], n_head: int, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Cut a full state dict (nn.Linear layout, [out, in]) down to rank `tp_rank`'s shard.

    c_attn's rows are [q | k | v], each n_head heads of head_dim rows: rank r keeps heads
    r·h .. (r+1)·h - 1 of each of the three (h = n_head / tp_size), so q, k and v of a head stay together.
    c_fc keeps a slice of its rows; both c_proj keep a slice of their columns (and the whole bias).
    Embeddings, LayerNorms and the LM head are replicated: every rank keeps them whole."""
    if tp_size == 1:
        return sd
    out = {}
    for name, w in sd.items():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            qkv = w.view(3, n_head, -1, *w.shape[1:])  # [3, H, D(, C)]
            h = n_head // tp_size
            w = qkv[:, tp_rank * h : (tp_rank + 1) * h].reshape(-1, *w.shape[1:])  # [3 · h · D(, C)]
        elif name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
            w = w.chunk(tp_size, dim=0)[tp_rank]  # rows: this rank's MLP features
        elif name.endswith("c_proj.weight"):  # attn.c_proj and mlp.c_proj: columns
            w = w.chunk(tp_size, dim=1)[tp_rank]
        out[name] = w.contiguous()
    return out
