"""One request's state while it is being generated.

A scheduler juggles many requests at once, so everything that belongs to one request
lives here rather than in local variables of a loop: its prompt, the tokens generated so
far, its KV cache, its SamplingParams and random generator, its streaming detokenizer,
and whether (and why) it has finished.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roseinfer.block_pool import hash_block
from roseinfer.detokenizer import Detokenizer
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from roseinfer.sequence_group import SequenceGroup


@dataclass(eq=False)  # a request is itself: compared by identity, not field by field
class InferenceSession:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: Detokenizer
    eos_token_id: int | None  # None: the model has no EOS to stop on
    max_context: int  # the model's context length
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the paged cache (stage 09: may grow in chunks)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (stage 10)
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block so far (stage 10)
    group: SequenceGroup | None = None  # the request's other sequences, when it has several (stage 11)
    index: int = 0  # which of the request's completions (or beams) this sequence is
    cumulative_logprob: float = 0.0  # sum of the log-probabilities of output_ids (kept for n > 1 and beams)
    pending_logprobs: torch.Tensor | None = None  # a beam's next-token log-probabilities [V], until its search steps
    spec_token_ids: list[int] = field(default_factory=list)  # stage 14: draft tokens proposed for the next step
    spec_draft_probs: torch.Tensor | None = None  # ... and the draft's q for each [k, V] (None: one-hot guesses)
    finish_reason: str | None = None
    last_delta: str = ""  # the text that became final with the latest token (for streaming)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far (prompt + generated)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start .. end-1 of the sequence (prompt, then generated), without copying all of it."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def fork(self, request_id: str, index: int, generator: torch.Generator) -> InferenceSession:
        """A child sequence (stage 11): the same tokens and KV so far, its own random stream and text."""
        return dataclasses.replace(
            self, request_id=request_id, index=index, generator=generator, output_ids=list(self.output_ids),
            detokenizer=self.detokenizer.fork(), block_hashes=list(self.block_hashes),
        )  # fmt: skip

    def update_block_hashes(self, block_size: int) -> list[bytes]:
        """Stage 10: the hash of every full block of the sequence so far, each computed once, each
        chained to the one before (see roseinfer/block_pool.py)."""
        for i in range(len(self.block_hashes), self.num_tokens // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.token_ids(i * block_size, (i + 1) * block_size)))
        return self.block_hashes

    def append_token(self, token_id: int) -> None:
        """Record a sampled token, stream it through the detokenizer, and decide whether we are done."""
        self.output_ids.append(token_id)
        self.last_delta = self.detokenizer.step(token_id)
        p = self.params
        hit_eos = token_id == self.eos_token_id and not p.ignore_eos
        if hit_eos or token_id in p.stop_token_ids or self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens or self.num_tokens >= self.max_context:
            self.finish_reason = "length"
        if self.finished:
            self.last_delta += self.detokenizer.flush()

    def output(self, delta: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            text=self.detokenizer.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            delta=delta,
            num_cached_tokens=self.num_cached_tokens,
            outputs=[CompletionOutput(0, self.detokenizer.text, list(self.output_ids), self.finish_reason)],
        )
