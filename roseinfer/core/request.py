"""A request as the scheduler sees it: token ids and counters, nothing else.

The core never sees text, a tokenizer or a tensor. A `Request` holds what scheduling needs:

    all_token_ids         prompt + generated ids, one list that only grows
    num_computed_tokens   how many of them have their K/V in the paged cache (a chunked prompt grows
                          in chunks; a decode by one per step; a preemption by recompute sets it to 0)
    block_hashes          the hash of every full block so far, for prefix caching (roseinfer/core/block_pool.py)
    spec_token_ids        draft tokens the model runner proposed for the next step (speculative decoding)
    structured_output_request   its grammar, when its text must follow one: the scheduler only asks `is_ready`
    num_candidates        0: the runner samples its tokens; k > 0: the runner returns its k most likely next
                          tokens (`candidates`) and the token is chosen outside (a beam search)
    finish_reason         None while it runs; "stop" (EOS, a stop token), "length" or "abort"

Stop strings need text, so they are not checked here: the output processor (roseinfer/engine/
output_processor.py) finds them and finishes the request through `Scheduler.finish_requests`.

Several sequences of one request (n completions, or the beams of a beam search) are requests of their
own, "r", "r#1", "r#2", ..., tied by a `RequestGroup`: they share KV blocks (fork and copy-on-write),
are admitted together and preempted together. A request that has a group when it is queued runs as that many
sequences from the start (`RequestGroup.num_seqs` places).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from roseinfer.core.block_pool import hash_block
from roseinfer.sampling_params import BeamSearchParams, SamplingParams


def as_token_ids(ids: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """None -> (), one id -> (id,), several -> a tuple of them."""
    return () if ids is None else (ids,) if isinstance(ids, int) else tuple(ids)


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "max_model_len",
                 "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "block_hashes",
                 "spec_token_ids", "finish_reason", "group", "index", "cumulative_logprob", "max_tokens",
                 "stop_token_ids", "num_output_placeholders", "min_tokens", "num_candidates", "candidates",
                 "structured_output_request")  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | BeamSearchParams,
        eos_token_ids: int | tuple[int, ...] | None,
        max_model_len: int,
    ):
        """`eos_token_ids`: the model's EOS id, or all of them (Llama 3 ends a turn with either of two)."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        eos = () if sampling_params.ignore_eos else as_token_ids(eos_token_ids)
        self.eos_token_ids = frozenset(eos)  # empty: never stop at EOS
        self.max_model_len = max_model_len
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_hashes: list[bytes] = []
        self.spec_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.group: RequestGroup | None = None
        self.index = 0  # which completion (or beam) of its request this sequence is
        self.cumulative_logprob = 0.0  # of the generated tokens (kept for n > 1)
        self.max_tokens = sampling_params.max_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.min_tokens = sampling_params.min_tokens  # no stop at EOS or a stop token before this many tokens
        self.num_output_placeholders = 0  # async scheduling: tokens sampled in steps whose output is not in yet
        self.num_candidates = 0  # > 0: its next token is chosen outside the runner, from this many candidates
        self.candidates: tuple[list[int], list[float]] | None = None  # the runner's, until the group's are all in
        self.structured_output_request = None  # its grammar, when it has a constraint (roseinfer/structured_output/)

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far (prompt + generated)."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token_in_flight(self) -> bool:
        """Async scheduling: the token on its way is this request's last (max_tokens, or a full context)."""
        p = self.num_output_placeholders
        return p > 0 and (self.num_output_tokens + p >= self.max_tokens or self.num_tokens + p >= self.max_model_len)

    @property
    def is_ready(self) -> bool:
        """False while its grammar is compiling (vLLM's WAITING_FOR_FSM): it waits, the requests behind it go."""
        return self.structured_output_request is None or self.structured_output_request.is_ready

    @property
    def speculates(self) -> bool:
        """Speculative decoding is for requests that decode alone and plainly: one completion, not a beam search,
        no logits processor, no log-probabilities (see SamplingParams.may_speculate)."""
        return self.group is None and self.sampling_params.may_speculate

    def append_token(self, token_id: int) -> bool:
        """Record a generated token and check the stops that need no text (vLLM's check_stop); True if the
        request is finished by it."""
        self.all_token_ids.append(token_id)
        if (token_id in self.eos_token_ids or token_id in self.stop_token_ids) and (
            len(self.all_token_ids) - self.num_prompt_tokens >= self.min_tokens
        ):
            self.finish_reason = "stop"
        elif len(self.all_token_ids) - self.num_prompt_tokens >= self.max_tokens or (
            len(self.all_token_ids) >= self.max_model_len
        ):
            self.finish_reason = "length"
        return self.finish_reason is not None

    def update_block_hashes(self, block_size: int) -> list[bytes]:
        """The hash of every full block of the sequence so far, each computed once, each chained to the one
        before (see roseinfer/core/block_pool.py)."""
        hashes, tokens = self.block_hashes, self.all_token_ids
        for i in range(len(hashes), len(tokens) // block_size):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size : (i + 1) * block_size]))
        return hashes

    def fork(self, request_id: str, index: int) -> Request:
        """A child sequence: the same tokens and computed K/V so far (its blocks are shared, not copied)."""
        child = Request(request_id, self.prompt_token_ids, self.sampling_params, None, self.max_model_len)
        child.eos_token_ids = self.eos_token_ids
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens, child.num_cached_tokens = self.num_computed_tokens, self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.group, child.index, child.cumulative_logprob = self.group, index, self.cumulative_logprob
        child.num_output_placeholders, child.num_candidates = self.num_output_placeholders, self.num_candidates
        if self.structured_output_request is not None:  # its own matcher, in the parent's state
            child.structured_output_request = self.structured_output_request.fork()
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"finish_reason={self.finish_reason!r})")  # fmt: skip


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one request with n > 1 completions or a beam search.

    parallel sampling (n = 3)     the prompt runs once, as one sequence "r"; in the step that computes its
                                  last prompt token the scheduler forks it into "r", "r#1", "r#2": the same
                                  blocks (reference count 3), each samples its own token from the same
                                  logits and then decodes on its own, copying a shared block before writing
    chosen outside (width 4)      a beam search: the running beams "r", "r#1", ...; once each has its
                                  candidates, roseinfer/engine/beam_search.py picks the next beams and the
                                  scheduler carries out its `GroupUpdate`: a beam two of them continue is
                                  forked, one that none continues is finished
    """

    group_id: str  # the request id the caller gave
    num_seqs: int  # n, or the beam width: the places it takes in the running batch at admission
    seqs: list[Request] = field(default_factory=list)  # n > 1: all completions by index; beams: the running ones
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_seq_id(self) -> str:
        return f"{self.group_id}#{next(self._ids)}"

    @property
    def live(self) -> list[Request]:
        return [s for s in self.seqs if not s.finished]
