"""The paged KV cache: one preallocated pool of blocks, for every layer.

Layout, per layer:   K, V : [num_blocks, block_size, num_key_value_heads, head_dim]

    physical block 0 │ slot 0 │ slot 1 │ … │ slot bs-1 │   each slot holds one token's
    physical block 1 │ slot 0 │ slot 1 │ … │ slot bs-1 │   K (or V) for all K/V heads: [Hkv, D]
    …

A token's slot number is `block_id * block_size + offset`, so a flat view of the pool
`[num_blocks * block_size, Hkv, D]` is indexed by slot directly. With grouped-query attention
(Llama, Qwen, Mistral) Hkv = num_key_value_heads is a fraction of the query heads, and so is the pool:
the same memory holds H / Hkv times more tokens. GPT-2 has Hkv = H. One block id covers all
layers: the block manager hands out ids, every layer's pool uses the same ones.

The model runner owns these tensors; nobody else holds them. A second pool of the same layout lives in
host memory (`host=True`), for sequences that are swapped out, and `swap_blocks` copies whole blocks
between the two. How many blocks the pool holds is decided before it is allocated: the number configured, or
on CUDA by default what is left of the card's share once the weights are in (`num_blocks_that_fit`).
"""

from __future__ import annotations

import torch

from roseinfer.model_executor.registry import ModelConfigType

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's (K pool, V pool), each [num_blocks, block_size, Hkv, D]


def bytes_per_block(config: ModelConfigType, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V, all layers, `block_size` tokens: 2 · layers · block_size · Hkv · head_dim · itemsize (on one
    rank of `tp_size`, which holds Hkv / tp_size of the K/V heads: 1 / tp_size of that)."""
    per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return 2 * per_token * block_size * dtype.itemsize // tp_size


def num_blocks_that_fit(device: torch.device, gpu_memory_utilization: float, block_bytes: int) -> int:
    """The blocks of `block_bytes` that fit in what is left of the CUDA device's share (gpu_memory_utilization of
    it) once what is there already (the weights) is counted; at least one."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization - (total - free))
    return max(1, budget // block_bytes)


class KVCache:
    def __init__(
        self,
        config: ModelConfigType,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        host: bool = False,
        tp_size: int = 1,
    ):
        """`tp_size`: this rank's pool holds only its num_key_value_heads / tp_size K/V heads.
        `host=True`: the swap pool, in CPU memory, pinned when the device is a GPU (so that copies
        to and from it can be asynchronous), and left uninitialised: a swap-out writes every block before
        it is read, and untouched pages of a large swap space cost no memory."""
        shape = (num_blocks, block_size, config.num_key_value_heads // tp_size, config.head_dim)

        def new() -> torch.Tensor:
            if host:
                return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
            # zeros, not empty: the reference attention masks unused slots, but NaN garbage is a bad default
            return torch.zeros(shape, dtype=dtype, device=device)

        self.layers: list[KV] = [(new(), new()) for _ in range(config.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.nbytes = num_blocks * bytes_per_block(config, block_size, dtype, tp_size)


def swap_blocks(src: list[KV], dst: list[KV], block_mapping: list[tuple[int, int]]) -> None:
    """Copy whole blocks from one pool to the other, in every layer: block s of `src` to block d of
    `dst` for each (s, d). Device -> host swaps out, host -> device swaps in. A block is one contiguous
    [block_size, H, D] slab, so each pair is one copy per layer and per K/V; from or to pinned memory
    they are asynchronous on CUDA (ordered on the stream before the forward that reads them)."""
    for (src_k, src_v), (dst_k, dst_v) in zip(src, dst, strict=True):
        for s, d in block_mapping:
            dst_k[d].copy_(src_k[s], non_blocking=True)
            dst_v[d].copy_(src_v[s], non_blocking=True)
