"""Warm-up: every oneDNN primitive a server will need, built at start-up (`warmup=True`; `roseinfer serve`'s default).

oneDNN builds and keeps a primitive for each shape of each linear layer (roseinfer/model_executor/onednn_linear.py),
about 0.65 MiB each (benchmarks/engine/onednn_primitives.py). Padding the rows to a few sizes bounds how many
there can be, but a server still meets a size for the first time long after it started: the largest come only
with the rare step that holds a long prompt. Each first time costs under a millisecond of building and memory
that is never given back, so a soak's RSS creeps up for hours (the bundled model at 28 req/s, with 126 sizes and
no warm-up: +1.26 MiB/min over 30 minutes). Building them all before the first request makes the memory a cost
paid once, at start-up, and flat from then on:

    1. record    one decode token of a dummy request through the model and the LM head, inside
                 `record_calls()`: which kinds of linear layer the model has (in, out, bias, post-op, dtype)
    2. warm up   each kind at every row bucket it can meet: the layers of the forward up to the token budget,
                 the LM head up to the rows a step samples (max_num_seqs, times k + 1 with speculation;
                 prompt log-probabilities can bring more, and those sizes are built when they come)

A draft model (speculative decoding) is recorded the same way, through its own pool: its layers up to the token
budget, its LM head up to max_num_seqs rows (one guess per request a round). Its first round for a request catches
up on the whole prompt at once, so a step of several new requests can bring more rows than the budget; those rare
sizes are built when they come. The dummy token writes its K/V into slot 0 of block 0 (of each pool) before any
request owns a block: nothing reads it.
"""

from __future__ import annotations

import torch

from roseinfer.attention import AttentionMetadata
from roseinfer.model_executor.onednn_linear import record_calls, warm_up


@torch.inference_mode()
def warm_up_linear_layers(runner) -> int:
    """Build the oneDNN primitives of every linear layer of `runner`'s model (and of its draft model, if it has one)
    at every row count a step can bring; returns the number of warm-up calls (0 when the layers do not run through
    oneDNN)."""
    config = runner.config
    if config.model_config.linear_backend != "onednn":
        return 0
    sched, spec = config.scheduler_config, config.speculative_config
    budget = sched.max_num_batched_tokens
    logit_rows = min(budget, sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
    layers, head = record_model(runner, runner.model, runner.kv_cache.layers, runner.gather_buffer)
    n = warm_up(layers, budget) + warm_up(head, logit_rows)
    draft = getattr(runner, "proposer", None)
    if getattr(draft, "model", None) is not None:  # a draft model (the n-gram proposer has none)
        draft_layers, draft_head = record_model(runner, draft.model, draft.kv_cache.layers, draft.gather_buffer)
        n += warm_up(_unseen(draft_layers, layers), budget)  # kinds the target shares are built already
        n += warm_up(_unseen(draft_head, head), min(budget, sched.max_num_seqs))
    return n


def _unseen(calls: dict, seen: dict) -> dict:
    return {key: args for key, args in calls.items() if key not in seen}


def record_model(runner, model, kv_layers, gather_buffer) -> tuple[dict, dict]:
    """One decode token of a dummy request through `model` (with its pool `kv_layers`) and its LM head, each inside
    `record_calls()`: the kinds of linear call of the forward, and of the head."""
    dev = runner.device
    ids = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]: one token, at position 0
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([0, 1], dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), num_decodes=1,
                             max_query_len=1, query_start_loc_cpu=[0, 1], seq_lens_cpu=[1], backend=runner.backend,
                             gather_buffer=gather_buffer)  # fmt: skip
    if runner.backend.prepare is not None:
        meta.plan = runner.backend.prepare(meta, runner.block_size)
    with record_calls() as layers:
        hidden = model.forward_paged(ids, ids, kv_layers, meta)  # [1, C]
    with record_calls() as head:
        model.compute_logits(hidden)
    return layers, head
