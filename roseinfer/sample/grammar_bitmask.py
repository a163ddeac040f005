"""Structured outputs in the sampler: a grammar's bitmask turns the tokens it does not allow into -inf logits.

The core sends, for the constrained rows of a step, one bitmask row each (roseinfer/structured_output/):

    bitmask [R, W] int32, W = ceil(V / 32)     token t is allowed  <=>  bit (t % 32) of word t // 32 is 1

    word 0 = 0b...0000_0110  ─►  tokens 1 and 2 allowed, 0 and 3..31 not      logits[r, t] = -inf where not

Applied before everything else that reads the logits (the processors, the temperature, greedy's argmax, the
rejection sampler's target probabilities), it leaves the model's distribution renormalised over what the
grammar allows: a greedy row picks the most likely allowed token, a sampled row draws among allowed tokens.

`apply_token_bitmask_reference` is the definition in PyTorch: it unpacks the bits into an [R, V] bool tensor and
fills. `apply_token_bitmask` runs a C++ kernel on the CPU (roseinfer/csrc/token_bitmask.cpp: a word of 32 allowed
tokens costs one compare, and no [R, V] tensor is made) and xgrammar's kernel on CUDA; both are tested equal to
the reference (tests/test_21_structured_outputs.py).
"""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, V] bool, True where the token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = (bitmask[:, :, None] >> bits) & 1  # [R, W, 32]: bit b of each word (>> keeps the sign: & 1 fixes it)
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [R, V]


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (in place) where bitmask [R, W] forbids a token: -inf. Returns logits."""
    return logits.masked_fill_(~unpack_bitmask(bitmask.to(logits.device), logits.shape[1]), float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Rows `rows` of logits [S, V] (in place) by bitmask [len(rows), W], row i of the mask to logits row rows[i]."""
    from roseinfer import custom_ops

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and custom_ops.available():
        torch.ops.roseinfer.apply_token_bitmask(logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.int64))
    elif logits.device.type == "cuda":  # xgrammar's kernel (never run on a GPU here)
        import xgrammar as xgr

        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)  # other rows: all allowed
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = apply_token_bitmask_reference(logits[index], bitmask)


def apply_grammar_bitmask(logits: torch.Tensor, first_row: dict[str, int], bitmask: np.ndarray,
                          req_ids: list[str], nrows: np.ndarray) -> None:  # fmt: skip
    """The step's bitmask on its logits: request req_ids[i] has nrows[i] rows of logits, in order (1, or k + 1
    when it verifies k drafts); a constrained one has as many bitmask rows from `first_row[id]` on."""
    starts = np.cumsum(nrows) - nrows
    logit_rows, mask_rows = [], []
    for i, rid in enumerate(req_ids):
        r = first_row.get(rid)
        if r is not None:  # (a constrained request whose prompt chunk samples nothing is simply not in req_ids)
            n = int(nrows[i])
            logit_rows += range(int(starts[i]), int(starts[i]) + n)
            mask_rows += range(r, r + n)
    if logit_rows:
        apply_token_bitmask(logits, torch.from_numpy(bitmask[mask_rows]), logit_rows)
