"""The paged KV cache: one preallocated pool of blocks, for every layer.

Layout, per layer:   K, V : [num_blocks, block_size, n_head, head_dim]

    physical block 0 │ slot 0 │ slot 1 │ … │ slot bs-1 │   each slot holds one token's
    physical block 1 │ slot 0 │ slot 1 │ … │ slot bs-1 │   K (or V) for all heads: [H, D]
    …

A token's slot number is `block_id * block_size + offset`, so a flat view of the pool
`[num_blocks * block_size, H, D]` is indexed by slot directly. One block id covers all
layers: the block manager hands out ids, every layer's pool uses the same ones.
"""

from __future__ import annotations

import torch

from roseinfer.model import KV, GPT2Config


def bytes_per_block(config: GPT2Config, block_size: int, dtype: torch.dtype) -> int:
    """K and V, all layers, `block_size` tokens: 2 · n_layer · block_size · n_embd · itemsize."""
    return 2 * config.n_layer * block_size * config.n_embd * dtype.itemsize


class KVCache:
    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, config.n_head, config.head_dim)
        # zeros, not empty: the reference attention masks unused slots, but NaN garbage is a bad default
        self.layers: list[KV] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.n_layer)
        ]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.nbytes = num_blocks * bytes_per_block(config, block_size, dtype)
