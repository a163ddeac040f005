"""Prompt log-probabilities: the LM head on every prompt position, chunk by chunk, for the requests that ask.

A step computes hidden states for every new token but the LM head runs only on the last one of each request
that samples. A request with `prompt_logprobs` also wants, for each prompt position p, how likely the model
found the prompt's next token p + 1:

    prompt        t0   t1   t2   t3   t4          (P = 5)
    chunk 1       t0   t1   t2                    rows p = 0, 1, 2 score t1, t2, t3
    chunk 2                      t3   t4          row p = 3 scores t4; p = 4 is the first sample's row
    result        None {t1} {t2} {t3} {t4}        (the first prompt token has nothing before it)

Each chunk's rows go through the LM head at most PROMPT_LOGITS_ROWS at a time (a [rows, V] block of logits
each), then through `compute_logprobs` (roseinfer/sample/logprobs.py); the request's state keeps the lists
and the next position it wants, so a position is gathered once even if a preempted request computes its
prompt again. Its blocks never come from the prefix cache (the scheduler skips the lookup for it): a cached
block's positions would not be computed at all.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from roseinfer.sample.logprobs import compute_logprobs, to_lists
from roseinfer.worker.input_batch import InputBatch
from roseinfer.worker.step_inputs import StepInputs

PROMPT_LOGITS_ROWS = 256  # prompt positions per LM-head call


def gather_prompt_logprobs(input_batch: InputBatch, step: StepInputs, hidden: torch.Tensor,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor],
                           to_device: Callable[[np.ndarray], torch.Tensor]) -> None:  # fmt: skip
    """The prompt log-probabilities of this step's chunks (hidden [N, C]); a request whose positions are all in
    waits in `input_batch.prompt_logprobs_ready` for the step that samples its first token."""
    hidden_rows, targets, parts, lengths, done = [], [], [], [], []
    for i in np.flatnonzero(input_batch.num_prompt_logprobs[step.rows] >= 0).tolist():
        row = int(step.rows[i])
        state = input_batch.row_state[row]
        start, end = int(step.seq_lens[i] - step.counts[i]), int(step.seq_lens[i])
        lo, hi = max(start, state.prompt_logprobs_next), min(end, state.num_prompt_tokens - 1)
        if hi > lo:
            p = np.arange(lo, hi)
            hidden_rows.append(step.query_start_loc[i] + p - start)  # [hi - lo] rows of this step's hidden states
            targets.append(input_batch.token_ids[row, p + 1])
            parts.append((state, hi))
            lengths.append(hi - lo)
        if (hi if hi > lo else state.prompt_logprobs_next) >= state.num_prompt_tokens - 1:
            done.append(state)
    if parts:
        nums = [int(input_batch.num_prompt_logprobs[s.row]) for s, _ in parts]
        hidden_rows, targets = np.concatenate(hidden_rows), torch.from_numpy(np.concatenate(targets))
        pieces, n = [], PROMPT_LOGITS_ROWS
        for a in range(0, len(hidden_rows), n):
            logits = compute_logits(hidden[to_device(hidden_rows[a : a + n])])  # [<= n, V]
            pieces.append([x.cpu() for x in compute_logprobs(logits, targets[a : a + n], max(nums))])
        ids, lps, ranks = (torch.cat(x) for x in zip(*pieces, strict=True))
        for (state, hi), lists in zip(parts, to_lists(ids, lps, ranks, nums, lengths), strict=True):
            state.prompt_logprobs.extend(lists)
            state.prompt_logprobs_next = hi  # (only now: a step that raised before this gathers them again)
    for state in done:
        input_batch.num_prompt_logprobs[state.row] = -1
        input_batch.num_prompt_logprob_rows -= 1
        input_batch.prompt_logprobs_ready.add(state.req_id)
