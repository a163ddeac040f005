"""Speculative decoding: guess k tokens cheaply, check them all in ONE forward of the model.

Decode computes one token per request per forward. But a forward over 1 + k tokens of a request costs
about as much as over 1 when decode is memory-bound (the weights are read once either way), so:

    propose    a cheap proposer guesses the next k tokens           d1 d2 d3 d4        (k = 4)
    verify     one forward of the target over [last, d1 .. d4]      p0 p1 p2 p3 p4     (5 next-token distributions)
    accept     keep the drafts the target agrees with, then one     d1 d2 ✓ ✓ ✗ → d1 d2 t3
               token of the target's own at the first miss          (or a bonus t5 if all 4 pass)

Every step still yields at least one token, and the tokens are exactly the ones the target would have
produced (greedy) or are distributed exactly as its samples (roseinfer/sample/rejection_sampler.py).

The proposer lives in the model runner, as in vLLM V1: right after a step has sampled, it guesses the next
k tokens of every request that decodes alone and plainly (not n > 1, not a beam, no penalty, logit_bias,
min_tokens or min_p, no logprobs: `SamplingParams.may_speculate`; the others run one token per step in the
same batch) from the runner's own token rows, and
the guesses travel back to the scheduler in `ModelRunnerOutput.spec_token_ids`; the scheduler books them
with the request's next step. A proposer reads the runner's rows and writes none: it returns a `DraftProposal`,
and the runner (`propose_draft_token_ids`) keeps the draft model's probabilities until it verifies the drafts.
Two proposers share one interface (`Proposer`):

    ngram          prompt lookup: find the request's last n tokens earlier in its own prompt + output,
                   propose what followed them there (no model at all)            `ngram.py`
    draft_model    a small model with the same tokenizer, run k times; its KV cache uses the target's
                   block tables (the scheduler books k slots ahead for it)      `draft_model.py`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from roseinfer.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from roseinfer.core.sched.output import ModelRunnerOutput
    from roseinfer.worker.model_runner import ModelRunner


@dataclass
class DraftProposal:
    """What a proposer guessed for the next step."""

    token_ids: dict[str, list[int]]  # request id -> at most k drafts
    probs: dict[str, torch.Tensor] | None = None  # request id -> q of each draft [k, V] (drafts that were sampled)


class Proposer(Protocol):
    def propose(self, runner: ModelRunner, out: ModelRunnerOutput) -> DraftProposal:
        """Drafts for the next step of every request of `out` that may speculate, read from the runner's rows. A
        proposer that samples its guesses also returns their distributions q (the rejection sampler needs them)."""

    def free(self, req_id: str) -> None:
        """The request finished: forget what is kept for it."""

    def invalidate(self, req_id: str, position: int) -> None:
        """The request's block table changed from `position` on (a swap-in, blocks given back)."""


def speculating_rows(runner: ModelRunner, out: ModelRunnerOutput, k: int) -> list[tuple[str, int, int]]:
    """(request id, row, drafts worth proposing) for the requests of this step that may speculate (n = 1, not a
    beam, no logits processor or logprobs), and with room to grow. A step yields up to drafts + 1 tokens, so
    never more drafts than the request may still generate (max_tokens) or the context can hold, minus one."""
    input_batch = runner.input_batch
    found = []
    for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
        state = input_batch.requests.get(rid)
        if not tokens or state is None or not state.params.may_speculate:
            continue
        row = state.row
        n = int(input_batch.num_tokens[row])
        left = min(int(input_batch.max_tokens[row]) - (n - state.num_prompt_tokens), input_batch.max_model_len - n)
        m = max(0, min(k, left - 1))
        if m:
            found.append((rid, row, m))
    return found


def make_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer:
    spec = config.speculative_config
    if spec.method == "ngram":
        from roseinfer.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from roseinfer.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, runner)
