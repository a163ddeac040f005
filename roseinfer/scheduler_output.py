"""SchedulerOutput: what one engine step computes (vLLM v1's name for the same contract).

The scheduler decides, the model runner executes, and this is all that passes between them:

    scheduled             [A, B, C]                    the requests that run this step
    num_scheduled_tokens  {A: 1, B: 1, C: 48}          tokens to compute now, per request, starting at
                                                       its num_computed_tokens: 1 for a decode, a chunk
                                                       of a prompt (or all of it) for a prefill
    block_tables          {A: [7, 2], B: [4], C: [9, 1, 3]}   already big enough for those tokens

A request only gets a next token when the step brings it to the end of its sequence
(num_computed_tokens + num_scheduled_tokens == num_tokens); a prompt chunk that stops short of the
end only fills the KV cache.

Before the forward the runner moves blocks, in this order: swap-outs (stage 12: their device blocks may
be handed to others in this very step), swap-ins, copy-on-write copies (stage 11: the source may be a
block that has just been swapped in).

Stage 14 (speculative decoding): a decoding request may also verify k draft tokens. It is scheduled for
1 + k tokens, its last token and the drafts, listed in `scheduled_spec_decode_tokens` (they are not the
request's tokens yet): `num_scheduled_tokens {A: 5}` with `scheduled_spec_decode_tokens {A: [d1, d2, d3, d4]}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.session import InferenceSession


@dataclass
class SchedulerOutput:
    scheduled: list[InferenceSession]  # the requests that run, in the scheduler's order
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    block_tables: dict[str, list[int]]  # request id -> physical block ids (the block manager's lists)
    scheduled_new_reqs: list[str] = field(default_factory=list)  # admitted for the first time
    scheduled_resumed_reqs: list[str] = field(default_factory=list)  # readmitted after a preemption
    preempted_req_ids: list[str] = field(default_factory=list)  # sent back to waiting by this step
    # stage 11: (parent, child) sequences forked this step: the child samples from the parent's last row
    forks: list[tuple[InferenceSession, InferenceSession]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    # stage 12: whole blocks to move between the device pool and the host pool, before the forward
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # stage 14: request id -> the draft tokens it verifies this step (they follow its last token in the batch)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """N, the rows of this step's forward pass: never more than the token budget."""
        return sum(self.num_scheduled_tokens.values())
