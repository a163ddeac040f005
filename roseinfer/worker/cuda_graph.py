"""CUDA graphs for decode steps: one forward captured per batch size, then replayed (as nano-vllm and vLLM do).

A decode step of a small model launches a few dozen kernels, each for microseconds of work; launching them
from Python costs about as much again, and the GPU waits. A CUDA graph records the launches once and replays
them with one call:

    capture (at start-up)     for bs in 1 2 4 8 16 32 48 ...: run the forward on static input buffers of bs
                              rows inside torch.cuda.graph(): every kernel and its arguments are recorded
    replay (each decode step) copy the step's input ids, positions, slots, lengths and block tables into the
                              first B rows of the buffers, pad to the next captured size bs >= B (padding rows
                              write no K/V: slot -1; attend to one token of block 0), replay, read B rows

Only whole-decode steps replay (every request brings one token); prefill chunks and verifications run
eagerly. Only the Triton backend can be captured: its kernels take every length from device memory, where
the sdpa backend plans on the host.
"""

from __future__ import annotations

import torch

from roseinfer.attention import AttentionMetadata
from roseinfer.worker.step_inputs import StepInputs


class CUDAGraphRunner:
    def __init__(self, runner, max_batch_size: int):
        self.runner = runner
        sizes = [1, 2, 4, 8, *range(16, max_batch_size + 1, 16)]
        self.batch_sizes = sorted({b for b in sizes if b <= max_batch_size} | {max_batch_size})
        bs, dev = self.batch_sizes[-1], runner.device
        self.max_blocks = runner.input_batch.block_table.table.shape[1]
        self.input_ids = torch.zeros(bs, dtype=torch.long, device=dev)  # static inputs: graphs read these addresses
        self.positions = torch.zeros(bs, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((bs,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.query_start_loc[: bs + 1], self.seq_lens[:bs],
                                 self.block_tables[:bs], num_decodes=bs, max_query_len=1,
                                 query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs,
                                 backend=self.runner.backend)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per batch size, largest first, all sharing one memory pool."""
        model, layers, pool = self.runner.model, self.runner.kv_cache.layers, None
        for bs in reversed(self.batch_sizes):
            meta = self._metadata(bs)
            model.forward_paged(self.input_ids[:bs], self.positions[:bs], layers, meta)  # warm-up: compiles kernels
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model.forward_paged(self.input_ids[:bs], self.positions[:bs], layers, meta)  # [bs, C]
            pool = pool or graph.pool()
            self.graphs[bs] = (graph, hidden)
        torch.cuda.synchronize(self.runner.device)

    def can_run(self, step: StepInputs) -> bool:
        meta = step.attn_metadata
        B = len(step.rows)
        return meta.max_query_len == 1 and self.batch_sizes[-1] >= B and meta.block_tables.shape[1] <= self.max_blocks

    def run(self, step: StepInputs) -> torch.Tensor:
        """hidden states [B, C] of a decode step, from the smallest captured graph that holds its B rows."""
        meta, B = step.attn_metadata, len(step.rows)
        bs = next(b for b in self.batch_sizes if b >= B)
        W = meta.block_tables.shape[1]
        self.input_ids[:B].copy_(step.input_ids, non_blocking=True)
        self.positions[:B].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:B].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:B].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:B, :W].copy_(meta.block_tables, non_blocking=True)
        if bs > B:  # padding rows: nothing to write, one token of block 0 to attend to
            self.slot_mapping[B:bs].fill_(-1)
            self.seq_lens[B:bs].fill_(1)
            self.block_tables[B:bs].zero_()
        graph, hidden = self.graphs[bs]
        graph.replay()
        return hidden[:B]
