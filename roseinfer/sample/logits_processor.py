"""Logits processors: what logit_bias, min_tokens and the three penalties do to a step's logits, all rows at once.

Before the sampler divides by the temperature, each row of logits may be changed by its request's knobs
(vLLM V1's order):

    raw logits [S, V] ─► + logit_bias ─► min_tokens: stop ids -inf ─► repetition ─► frequency, presence ─► sampler

    logit_bias          logits[t] += bias[t]
    min_tokens          while fewer than min_tokens are out: logits[EOS and stop_token_ids] = -inf
    repetition_penalty  for t in prompt or output: logits[t] / p if logits[t] > 0 else logits[t] * p  (HF's rule)
    frequency_penalty   logits[t] -= frequency_penalty · count[t]         count: times t was generated
    presence_penalty    logits[t] -= presence_penalty · (count[t] > 0)    (OpenAI's rules; the prompt does not count)

and after the temperature, min_p drops tokens with probability below min_p · the row's top probability.

Each processor touches only the rows that use it: bias and masks are flat (row, token) index lists, the
penalties gather their rows' counts. A batch that uses none of them gets no `LogitsProcessors` at all.

The penalties need to know, per row, how often each token was generated. Recounting a request's history at
every step would cost O(length); the persistent batch (roseinfer/worker/input_batch.py) keeps instead

    output_counts [rows, V] int32   times each token was sampled: one scatter-add of the step's sampled column
    prompt_mask   [rows, V] bool    the prompt's tokens: set once, when the row is added

allocated only while some request in the batch uses a penalty, and copied with a row when it forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsProcessors:
    """The processors of one step's S rows (on the logits' device); a None field: no row uses it."""

    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B] row, [B] token id)
    bias_values: torch.Tensor | None = None  # [B] float32
    masked: tuple[torch.Tensor, torch.Tensor] | None = None  # ([M] row, [M] token id): min_tokens' stop ids
    penalty_rows: torch.Tensor | None = None  # [R] which rows have penalties
    output_counts: torch.Tensor | None = None  # [R, V] int32, their counts (gathered)
    prompt_mask: torch.Tensor | None = None  # [R, V] bool
    presence: torch.Tensor | None = None  # [R] float32
    frequency: torch.Tensor | None = None  # [R]
    repetition: torch.Tensor | None = None  # [R]
    min_p: torch.Tensor | None = None  # [S] float32 (applied by the sampler, after the temperature)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Everything before the temperature, in place on float32 logits [S, V]; returns them."""
        if self.bias_index is not None:
            logits.index_put_(self.bias_index, self.bias_values, accumulate=True)
        if self.masked is not None:
            logits[self.masked] = float("-inf")
        if self.penalty_rows is not None:
            rows = self.penalty_rows
            logits[rows] = apply_penalties(logits[rows], self.output_counts, self.prompt_mask, self.presence,
                                           self.frequency, self.repetition)  # fmt: skip
        return logits


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                    ) -> torch.Tensor:  # fmt: skip
    """Repetition, then frequency and presence: [R, V] logits, [R, V] counts and prompt mask, [R] penalties."""
    generated = output_counts > 0  # [R, V]
    rep = repetition[:, None]  # [R, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | generated, penalised, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * generated


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero every token whose probability is below min_p times its row's top probability, and renormalise.
    probs [S, V] (rows sum to 1), min_p [S] (0: keep all) -> [S, V]."""
    top = probs.amax(dim=-1, keepdim=True)  # [S, 1]
    probs = torch.where(probs < min_p[:, None] * top, 0.0, probs)
    return probs / probs.sum(dim=-1, keepdim=True)
