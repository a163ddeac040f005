"""Log-probabilities for a batch of positions: each position's own token and the N most likely, with its rank.

    logits [R, V] ─► log_softmax ─► lp [R, V] ─┬─► lp[r, token_r]                   its own token's value
                                               ├─► #{t : lp[r, t] >= lp[r, token_r]} its rank (1 = the most likely)
                                               └─► topk(N)                           the N most likely, best first

A position's own token is the token sampled there (`logprobs`) or the prompt's next token (`prompt_logprobs`).
The values are the model's distribution, the log-softmax of the raw logits, before any penalty, bias or
temperature (vLLM's default, "raw_logprobs"); so they are what Hugging Face's `output_logits` give.

One call handles every position that wants them in a step, with the largest N any of them asked for; each
request then keeps its first 1 + N columns (`LogprobsLists` in roseinfer/core/sched/output.py).
"""

from __future__ import annotations

import torch

from roseinfer.core.sched.output import LogprobsLists


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num: int) -> tuple[torch.Tensor, ...]:
    """logits [R, V], token_ids [R], N -> (ids [R, 1 + N] int64, logprobs [R, 1 + N] float32, ranks [R] int64):
    column 0 is the position's own token, columns 1 .. N the top N."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    token_ids = token_ids.to(lp.device, torch.long)
    own = lp.gather(1, token_ids[:, None])  # [R, 1]
    ranks = (lp >= own).sum(dim=-1)  # [R] how many tokens are at least as likely (itself included)
    if num == 0:
        return token_ids[:, None], own, ranks
    top = lp.topk(min(num, lp.shape[1]), dim=-1)  # [R, N], most likely first
    return torch.cat([token_ids[:, None], top.indices], 1), torch.cat([own, top.values], 1), ranks


def to_lists(ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, nums: list[int],
             lengths: list[int]) -> list[LogprobsLists]:  # fmt: skip
    """Split the rows of `compute_logprobs` (host tensors) by request: request i has the next `lengths[i]` rows
    and keeps 1 + nums[i] columns of each."""
    ids_l, lp_l, rank_l = ids.tolist(), logprobs.tolist(), ranks.tolist()
    out, at = [], 0
    for n, length in zip(nums, lengths, strict=True):
        k, end = 1 + n, at + length
        out.append(LogprobsLists([r[:k] for r in ids_l[at:end]], [r[:k] for r in lp_l[at:end]], rank_l[at:end]))
        at = end
    return out
