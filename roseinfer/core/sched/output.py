"""The contract between the scheduler and the model runner, data only (vLLM V1's names).

The scheduler decides what one step computes; the model runner keeps its own state for every request it
has seen (token ids, block table, sampling parameters: roseinfer/worker/input_batch.py) and is only told
what changed. Nothing here is a live object of the other side: ids, numbers and lists, so the same
message can be pickled to another process (tensor parallelism) or read by a test.

    SchedulerOutput
      step_id                7                    which step this is (the scheduler counts 0, 1, 2, ...): with
                                                  async scheduling its outputs come back a step later, and
                                                  the scheduler finds what it scheduled by this number
      scheduled_new_reqs     [NewRequestData]     first time the runner sees them: prompt ids, params,
                                                  block table, num_computed_tokens (a prefix-cache hit
                                                  starts past its shared blocks)
      scheduled_cached_reqs  CachedRequestData    requests the runner knows, one column per field:
                                                  num_computed_tokens at the start of this step, the tail
                                                  of the block table that changed ((j, ids): from index j
                                                  on), tokens chosen outside the runner's sampler (a
                                                  request with candidates), resumed after a preemption
      num_scheduled_tokens   {A: 1, B: 1, C: 48}  tokens to compute now, from num_computed_tokens on: 1 for
                                                  a decode, a chunk of a prompt (or all of it), 1 + k when
                                                  verifying k drafts
      scheduled_spec_decode_tokens {A: [d1, d2]}  the drafts each verifying request checks this step
      forks                  [ForkedRequest]      new sequences that copy a parent's state (n > 1, a group's fork)
      blocks_to_swap_out / blocks_to_swap_in / blocks_to_copy    block moves, before the forward, in that
                                                  order (a swapped-out block may be reused in this step;
                                                  a copy may read a block that has just been swapped in)
      finished_req_ids       ids whose state the runner can drop
      grammar_bitmask        structured outputs: the tokens each constrained request may take now, one bit per
                             token ([rows, ceil(V/32)] int32), and `structured_output_request_ids` its first row

A request gets a next token only when the step brings it to the end of its sequence (num_computed_tokens
+ num_scheduled_tokens == its number of tokens, plus its drafts); a prompt chunk that stops short only
fills the KV cache.

    ModelRunnerOutput       what came back: per request that reached its end, the tokens it got (one, or
                            the accepted drafts and one more), the log-probabilities asked for (and those
                            that n > 1 needs), the candidates of the requests whose token is chosen outside,
                            the drafts proposed for the next step, and the requests that failed in the runner

Some requests do not sample: a request with `num_candidates` k > 0 gets back its k most likely next tokens
(`ModelRunnerOutput.candidates`), and its next token is chosen outside the runner. The scheduler keeps them
until every sequence of the request's group has its own, then reports them together
(`EngineCoreOutput.candidates`); whoever chooses (the beam search, roseinfer/engine/beam_search.py) answers
with a `GroupUpdate`, which the scheduler carries out: forks, finishes, the chosen tokens, the new order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | BeamSearchParams
    block_ids: list[int]
    num_computed_tokens: int
    num_candidates: int = 0  # > 0: no sample; its num_candidates most likely next tokens go back instead


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as columns (one entry per request, in the same order)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # tokens the runner did not sample itself
    new_block_ids: list[tuple[int, list[int]] | None] = field(default_factory=list)  # (j, table[j:]) or None
    num_computed_tokens: list[int] = field(default_factory=list)  # at the start of this step


@dataclass
class ForkedRequest:
    """`child_id` starts as a copy of `parent_id`: its token ids, and a block table sharing the parent's blocks.

    `sample_now`: n > 1 completions forked in the step that computes the parent's last prompt token; the
    child is not scheduled itself but samples its own first token from the parent's last row of logits.
    Otherwise (a fork made between steps by a `GroupUpdate`) the child is scheduled like any request."""

    parent_id: str
    child_id: str
    index: int  # which completion: a seeded request's child i draws from seed + i
    block_ids: list[int]
    sample_now: bool


@dataclass
class SchedulerOutput:
    step_id: int = 0  # assigned by the scheduler, increasing
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens computed now
    total_num_scheduled_tokens: int = 0  # N, the rows of this step's forward: never more than the token budget
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    forks: list[ForkedRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)  # sent back to waiting or swapped by this step
    # structured outputs (filled by the core after scheduling: roseinfer/structured_output/): bit t of a row says
    # token t may come next; a constrained request's rows start at its entry (1 row, or 1 + k with k drafts)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: object = None  # a numpy array [rows, ceil(V / 32)] int32 (made by the core, which imports no
    # numpy itself: roseinfer/structured_output/); None: no row is constrained


@dataclass
class LogprobsLists:
    """Log-probabilities at some positions of one sequence, as plain lists (vLLM's LogprobsLists). Per position:

    logprob_token_ids    [the position's own token (sampled, or the prompt's next token), top 1, .. top N]
    logprobs             their log-probabilities (the model's log-softmax)
    sampled_token_ranks  the position's own token's rank (1 = most likely)
    """

    logprob_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    sampled_token_ranks: list[int] = field(default_factory=list)

    def extend(self, other: LogprobsLists) -> None:
        self.logprob_token_ids += other.logprob_token_ids
        self.logprobs += other.logprobs
        self.sampled_token_ranks += other.sampled_token_ranks


@dataclass
class ModelRunnerOutput:
    """Per request that reached the end of its sequence this step (in `req_ids` order):

    sampled_token_ids   its new tokens: one, or the drafts the target accepted and one of its own; [] for a
                        request with candidates, which returns those instead
    logprobs            request id -> the sampled tokens' log-probabilities (requests with `logprobs`, and
                        n > 1 for the cumulative log-probability): one position per sampled token
    prompt_logprobs     request id -> its prompt's log-probabilities, positions 1 .. P - 1, in the step that
                        samples its first token (the runner gathers them chunk by chunk until then)
    candidates          request id -> (token ids, log-probabilities) of its `num_candidates` most likely next
                        tokens, best first (a request whose next token is chosen outside the runner)
    spec_token_ids      request id -> the drafts proposed for its next step (speculative decoding)
    errors              request id -> why it failed in the runner (the rest of the step ran without it)
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()


@dataclass(slots=True)
class EngineCoreOutput:
    """What the core reports about one request after a step (the output processor turns it into text).

    A sequence of a request with n > 1 completions reports under its own id, with its `group_id` and
    `index`. A group whose next tokens are chosen outside reports, under its id, every running sequence's
    `candidates` (sequence id -> (token ids, log-probabilities)); a request that ends with all its completions
    at once (a beam search) reports them once, best first, in `completions`."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    group_id: str | None = None
    index: int = 0
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    completions: list[tuple[list[int], float, str]] | None = None  # (token ids, cum. log-probability, finish)
    new_logprobs: LogprobsLists | None = None  # one position per new token (requests that asked)
    new_prompt_logprobs: LogprobsLists | None = None  # with the first token: prompt positions 1 .. P - 1
    error: str | None = None  # finish_reason "error": why
    candidates: dict[str, tuple[list[int], list[float]]] | None = None


@dataclass
class GroupUpdate:
    """The next sequences of a group, chosen outside the runner; the scheduler carries it out
    (`Scheduler.update_group`). Sequence `seq_ids[i]` continues `parent_ids[i]` with `token_ids[i]`:

        running  r (parent of two), r#1 (of none)      seq_ids    [r,   r#2, ...]
                                                        parent_ids [r,   r,   ...]   r#2 is forked from r
                                                        token_ids  [[7], [9], ...]   r#1 is finished

    a new id is a fork of its parent (sharing its blocks), a sequence nobody continues is finished with
    `finish_reason`, and the group's sequences then run in this order. No sequences: the group is done."""

    group_id: str
    seq_ids: list[str]
    parent_ids: list[str]
    token_ids: list[list[int]]
    finish_reason: str = "abort"


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the start: verifications ("drafts": a request's drafts checked in one step),
    the draft tokens they checked, the ones kept, and how many were kept at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1
