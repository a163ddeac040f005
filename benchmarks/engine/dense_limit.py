"""The `dense-limit` row of scripts/benchmark.py: how fast could this machine decode this workload at all?

A bare decode loop over the same weights, with everything an engine adds taken away. It replays the
decode steps an ideal continuous batcher would run for the workload: up to `batch_size` requests at once,
one new token each per step, a finished request replaced by the next one in the same step, prefill for
free. Each of those steps is one dense forward at that step's batch size: every row's K/V sit in one
contiguous preallocated tensor [B, H, L, D] per layer (no blocks, no tables, no gather), attention is one
SDPA call on a slice of it (every row at the step's mean context length, so no mask either), the next token
is an argmax. No scheduling, no prefill, no padding, no sampling or detokenizing. An engine that reaches a
large fraction of this is limited by the model's arithmetic on this machine, not by its own bookkeeping.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F


def ideal_steps(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> list[list[int]]:
    """For each decode step of an ideal continuous batcher (FCFS), the context length of every active request."""
    waiting, active, steps = deque(range(len(prompt_lens))), {}, []
    while waiting or active:
        while waiting and len(active) < batch_size:
            active[waiting.popleft()] = 0  # tokens generated so far
        steps.append([prompt_lens[r] + done for r, done in active.items()])
        for r in list(active):
            active[r] += 1
            if active[r] == output_lens[r]:
                del active[r]
    return steps


@torch.inference_mode()
def run_dense_limit(wl, model_dir: Path, device, dtype, batch_size: int):
    from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir

    path = resolve_model_dir(str(model_dir))
    model = load_model(path, read_model_config(path), torch.device(device), dtype)
    cfg, tr = model.config, model.transformer
    H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
    steps = ideal_steps([len(p) for p in wl.prompts], wl.output_lens, batch_size)
    B = max(map(len, steps))
    L = min(cfg.n_positions, max(round(sum(s) / len(s)) + 1 for s in steps))
    g = torch.Generator(device=device).manual_seed(0)
    caches = [
        (torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype),
         torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype))
        for _ in tr.h
    ]  # fmt: skip
    tokens = torch.randint(0, cfg.vocab_size - 1, (B,), generator=g, device=device)

    def step(b: int, t: int) -> torch.Tensor:  # one decode step for b rows, the new token at position t
        x = tr.wte(tokens[:b]) + tr.wpe.weight[t]  # [b, C]
        for block, (k_cache, v_cache) in zip(tr.h, caches, strict=True):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=1)  # 3 × [b, C]
            k_cache[:b, :, t] = k.view(b, H, D)
            v_cache[:b, :, t] = v.view(b, H, D)
            y = F.scaled_dot_product_attention(q.view(b, H, 1, D), k_cache[:b, :, : t + 1], v_cache[:b, :, : t + 1],
                                               scale=block.attn.scale)  # fmt: skip
            x = x + block.attn.c_proj(y.reshape(b, C))  # [b, H, 1, D] -> [b, C]
            x = x + block.mlp(block.ln_2(x))
        return model.compute_logits(tr.ln_f(x)).argmax(dim=-1)  # [b]

    step(B, L - 1)  # warm-up
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ctx in steps:
        tokens[: len(ctx)] = step(len(ctx), min(L, round(sum(ctx) / len(ctx)) + 1) - 1)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return [[0] * n for n in wl.output_lens], time.perf_counter() - t0  # as many tokens as asked, per request
