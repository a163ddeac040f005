"""The persistent input batch: the model runner's own state for every request it has seen, as array rows.

A request gets a row when the runner first sees it and keeps it until the scheduler says it finished
(preempted requests keep theirs: their tokens are still needed). Each row holds

    token_ids [rows, max_model_len]  int64   prompt + generated ids; the runner writes each token it samples,
                                             so the scheduler never sends token ids back (only the ones the
                                             runner could not know: tokens chosen from its candidates)
    num_tokens, num_computed_tokens [rows]
    block table [rows, max_blocks]           roseinfer/worker/block_table.py
    temperature, top_k, top_p, max_tokens    the sampling parameters as numbers, gathered per step into the
                                             sampler's columns (roseinfer/sample/sampler.py)
    presence/frequency/repetition_penalty,   the logits processors' numbers (roseinfer/sample/logits_processor.py);
    min_tokens, min_p, uses_processors       a request's logit_bias and stop ids live in its CachedRequestState
    num_logprobs, num_prompt_logprobs        N of the top-N log-probabilities it wants (-1: none)
    output_counts, prompt_mask [rows, V]     tokens generated / in the prompt, for the penalties (torch, on the
                                             device; only while some row uses a penalty)

A step then works on whole columns: the rows of the scheduled requests are one index array, and every
per-token array of the forward (input ids, positions, slots) is one vectorised numpy expression over
them. Nothing per step costs Python work that grows with a request's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.core.sched.output import LogprobsLists
from roseinfer.sample.logits_processor import LogitsProcessors
from roseinfer.sample.sampler import SamplingTensors
from roseinfer.sampling_params import SAMPLING_EPS, BeamSearchParams, SamplingParams
from roseinfer.worker.block_table import BlockTable

_COLUMNS = ("token_ids", "num_tokens", "num_computed_tokens", "num_prompt_tokens", "max_tokens", "temperature", "top_k",
            "top_p", "seeded", "num_candidates", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_tokens", "min_p", "uses_processors", "uses_penalties", "num_logprobs",
            "num_prompt_logprobs")  # fmt: skip


@dataclass
class CachedRequestState:
    """What the runner keeps of a request besides its row's numbers."""

    req_id: str
    row: int
    params: SamplingParams | BeamSearchParams
    num_prompt_tokens: int
    generator: torch.Generator | None  # its own random stream (seeded requests only)
    num_candidates: int = 0  # > 0: return its num_candidates most likely next tokens instead of sampling
    bias_ids: np.ndarray | None = None  # logit_bias: token ids [B] and their biases [B]
    bias_values: np.ndarray | None = None
    stop_ids: np.ndarray | None = None  # min_tokens: the ids masked until min_tokens are out (EOS, stop_token_ids)
    prompt_logprobs: LogprobsLists | None = None  # gathered chunk by chunk, until its first token is sampled
    prompt_logprobs_next: int = 0  # the next prompt position whose logits are wanted


class InputBatch:
    def __init__(self, max_model_len: int, max_blocks_per_req: int, block_size: int, vocab_size: int,
                 device: torch.device, capacity: int = 64, eos_token_ids: tuple[int, ...] = (),
                 samples: bool = True):  # fmt: skip
        """`eos_token_ids`: masked with min_tokens (unless ignore_eos); `samples`: this runner samples (the
        tensor-parallel workers do not, and keep no penalty counts)."""
        self.max_model_len, self.vocab_size, self.device = max_model_len, vocab_size, torch.device(device)
        self.eos_token_ids, self.samples = tuple(eos_token_ids), samples
        self.requests: dict[str, CachedRequestState] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self.token_ids = np.zeros((capacity, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_computed_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(capacity, dtype=np.int64)
        self.max_tokens = np.zeros(capacity, dtype=np.int64)
        self.temperature = np.zeros(capacity, dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.top_p = np.ones(capacity, dtype=np.float32)
        self.seeded = np.zeros(capacity, dtype=bool)
        self.num_candidates = np.zeros(capacity, dtype=np.int64)  # > 0: its best next tokens go back, no sample
        self.presence_penalty = np.zeros(capacity, dtype=np.float32)
        self.frequency_penalty = np.zeros(capacity, dtype=np.float32)
        self.repetition_penalty = np.ones(capacity, dtype=np.float32)
        self.min_tokens = np.zeros(capacity, dtype=np.int64)
        self.min_p = np.zeros(capacity, dtype=np.float32)
        self.uses_processors = np.zeros(capacity, dtype=bool)  # any of bias, min_tokens, penalties, min_p
        self.uses_penalties = np.zeros(capacity, dtype=bool)
        self.num_logprobs = np.full(capacity, -1, dtype=np.int64)  # n > 1 without logprobs: 0 (cumulative logprob)
        self.num_prompt_logprobs = np.full(capacity, -1, dtype=np.int64)  # -1 again once they are gathered
        self.block_table = BlockTable(capacity, max_blocks_per_req, block_size)
        self.generators: dict[int, torch.Generator] = {}  # row -> generator, seeded rows only
        self.num_processor_rows = self.num_penalty_rows = 0  # live rows that use them: 0 -> nothing to do
        self.num_logprob_rows = self.num_prompt_logprob_rows = 0
        self.output_counts: torch.Tensor | None = None  # [capacity, V] int32, while num_penalty_rows > 0
        self.prompt_mask: torch.Tensor | None = None  # [capacity, V] bool
        self.prompt_logprobs_ready: set[str] = set()  # gathered, waiting for the step that samples the first token
        self.row_state: dict[int, CachedRequestState] = {}

    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def _grow(self) -> None:
        old, new = self.capacity, 2 * self.capacity
        for name in _COLUMNS:
            a = getattr(self, name)
            b = np.zeros((new, *a.shape[1:]), dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self.top_p[old:] = self.repetition_penalty[old:] = 1.0
        self.num_logprobs[old:] = self.num_prompt_logprobs[old:] = -1
        for name in ("output_counts", "prompt_mask"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, torch.zeros_like(t)]))
        self.block_table.grow(new)
        self._free_rows = list(range(new - 1, old - 1, -1)) + self._free_rows

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                    block_ids: list[int], num_computed_tokens: int, generator: torch.Generator | None,
                    num_candidates: int = 0) -> CachedRequestState:  # fmt: skip
        """A row for a request. If anything about it fails, the row is given back and the error raised (the
        runner then fails that request alone)."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        try:
            state = self._fill_row(row, req_id, prompt_token_ids, params, block_ids, num_computed_tokens, generator)
        except BaseException:
            self._release_row(row)
            self.requests.pop(req_id, None)
            self.req_id_to_row.pop(req_id, None)
            raise
        state.num_candidates = self.num_candidates[row] = num_candidates
        return state

    def _fill_row(self, row: int, req_id: str, prompt_token_ids: list[int], params, block_ids: list[int],
                  num_computed_tokens: int, generator: torch.Generator | None) -> CachedRequestState:  # fmt: skip
        n = len(prompt_token_ids)
        self.token_ids[row, :n] = prompt_token_ids
        _check_ids("prompt token ids", self.token_ids[row, :n], self.vocab_size)
        self.num_tokens[row] = self.num_prompt_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table.set_row(row, block_ids)
        self.max_tokens[row] = params.max_tokens
        self.temperature[row] = params.temperature
        self.top_k[row] = self.vocab_size if params.top_k < 1 else min(params.top_k, self.vocab_size)
        self.top_p[row] = params.top_p
        self.seeded[row] = generator is not None
        if generator is not None:
            self.generators[row] = generator
        state = CachedRequestState(req_id, row, params, n, generator)
        self.requests[req_id] = state
        self.req_id_to_row[req_id] = row
        self.row_state[row] = state
        self._set_sampling_columns(state, params, prompt_token_ids)
        return state

    def _set_sampling_columns(self, state: CachedRequestState, p: SamplingParams, prompt_token_ids: list[int]) -> None:
        """The logits processors' and the log-probabilities' columns of a sampling request's row."""
        row = state.row
        want = p.logprobs if p.logprobs is not None else (0 if p.n > 1 else -1)
        self.num_logprobs[row] = want
        self.num_logprob_rows += want >= 0
        if p.prompt_logprobs is not None:
            self.num_prompt_logprobs[row] = p.prompt_logprobs
            self.num_prompt_logprob_rows += 1
            state.prompt_logprobs = LogprobsLists()
        if not p.uses_logits_processors:
            return
        self.uses_processors[row] = True
        self.num_processor_rows += 1
        self.min_tokens[row], self.min_p[row] = p.min_tokens, p.min_p
        if p.logit_bias:
            state.bias_ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            state.bias_values = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
            _check_ids("logit_bias", state.bias_ids, self.vocab_size)
        if p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            state.stop_ids = np.array(sorted(stops), dtype=np.int64)
            _check_ids("stop_token_ids", state.stop_ids, self.vocab_size)
        if p.uses_penalties:
            self.presence_penalty[row], self.frequency_penalty[row] = p.presence_penalty, p.frequency_penalty
            self.repetition_penalty[row] = p.repetition_penalty
            self.uses_penalties[row] = True
            self.num_penalty_rows += 1
            if self.samples:
                self._start_counts(row, prompt_token_ids)

    def _start_counts(self, row: int, prompt_token_ids: list[int]) -> None:
        """A penalised row's counts: nothing generated yet, its prompt's tokens marked."""
        if self.output_counts is None:  # the first penalised request in the batch
            shape = (self.capacity, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.output_counts[row] = 0
        self.prompt_mask[row] = False
        self.prompt_mask[row, torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device)] = True

    def fork(self, parent_id: str, child_id: str, block_ids: list[int], generator: torch.Generator | None) -> None:
        """A child row: the parent's tokens and parameters, its own block table and random stream."""
        parent = self.requests[parent_id]
        n, computed = int(self.num_tokens[parent.row]), int(self.num_computed_tokens[parent.row])
        prompt = self.token_ids[parent.row, : parent.num_prompt_tokens].tolist()
        child = self.add_request(child_id, prompt, parent.params, block_ids, computed, generator, parent.num_candidates)
        self.token_ids[child.row, :n] = self.token_ids[parent.row, :n]
        self.num_tokens[child.row] = n
        if self.num_prompt_logprobs[child.row] >= 0:  # the prompt's log-probabilities are its parent's to report
            self.num_prompt_logprobs[child.row] = -1
            self.num_prompt_logprob_rows -= 1
            child.prompt_logprobs = None
        if self.uses_penalties[child.row] and self.output_counts is not None:
            self.output_counts[child.row] = self.output_counts[parent.row]

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        del self.req_id_to_row[req_id]
        self.prompt_logprobs_ready.discard(req_id)
        self._release_row(state.row)

    def _release_row(self, row: int) -> None:
        """Give a row back: its counters drop, its penalty counts go once no penalised row is left."""
        self.generators.pop(row, None)
        self.row_state.pop(row, None)
        self.seeded[row] = False
        self.num_candidates[row] = 0
        self.num_logprob_rows -= self.num_logprobs[row] >= 0
        self.num_prompt_logprob_rows -= self.num_prompt_logprobs[row] >= 0
        self.num_processor_rows -= self.uses_processors[row]
        self.num_penalty_rows -= self.uses_penalties[row]
        self.num_logprobs[row] = self.num_prompt_logprobs[row] = -1
        self.uses_processors[row] = self.uses_penalties[row] = False
        self.min_tokens[row], self.min_p[row] = 0, 0.0  # (min_p is read for every row of a step that uses one)
        if not self.num_penalty_rows:
            self.output_counts = self.prompt_mask = None
        self._free_rows.append(row)

    # ---- per step ---------------------------------------------------------------------------
    def rows(self, req_ids) -> np.ndarray:
        get = self.req_id_to_row.__getitem__
        return np.fromiter(map(get, req_ids), dtype=np.int64, count=len(req_ids))

    def append_tokens(self, row: int, tokens: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def append_token_column(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One new token for each of `rows` (no row twice), in one go."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def count_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step's sampled column into the penalty counts (rows [S] on the device, no row twice; tokens [S])."""
        if self.output_counts is not None:
            self.output_counts[rows, tokens] += 1

    def sampling_tensors(self, rows: np.ndarray, device: torch.device) -> SamplingTensors:
        """The sampler's columns for the rows that sample this step, in that order."""
        temp = self.temperature[rows]
        all_greedy = not (temp >= SAMPLING_EPS).any()
        procs = self.logits_processors(rows, device) if self.num_processor_rows else None
        if all_greedy:  # the argmax needs none of the columns
            return SamplingTensors(None, None, None, True, False, {}, procs)
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        needs_filter = not all_greedy and bool(((top_k < self.vocab_size) | (top_p < 1.0)).any())
        gens = {}
        if self.generators:
            seeded = np.flatnonzero(self.seeded[rows])
            gens = {int(i): self.generators[int(rows[i])] for i in seeded}
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return SamplingTensors(to(temp), to(top_k), to(top_p), all_greedy, needs_filter, gens, procs)

    def logits_processors(self, rows: np.ndarray, device: torch.device) -> LogitsProcessors | None:
        """The processors of the rows that sample this step (None if none of them uses one): flat (row, token)
        lists for logit_bias and for the stop ids min_tokens masks, the penalised rows' counts, min_p."""
        use = np.flatnonzero(self.uses_processors[rows])
        if not len(use):
            return None
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        lp = LogitsProcessors()
        states = [self.row_state[r] for r in rows[use].tolist()]
        bias = [(i, s) for i, s in zip(use.tolist(), states, strict=True) if s.bias_ids is not None]
        if bias:
            lp.bias_index = (to(np.repeat([i for i, _ in bias], [len(s.bias_ids) for _, s in bias])),
                             to(np.concatenate([s.bias_ids for _, s in bias])))  # fmt: skip
            lp.bias_values = to(np.concatenate([s.bias_values for _, s in bias]))
        r = rows[use]
        short = (self.num_tokens[r] - self.num_prompt_tokens[r]) < self.min_tokens[r]  # still under min_tokens
        masked = [(i, s) for i, s, m in zip(use.tolist(), states, short.tolist(), strict=True) if m and len(s.stop_ids)]
        if masked:
            lp.masked = (to(np.repeat([i for i, _ in masked], [len(s.stop_ids) for _, s in masked])),
                         to(np.concatenate([s.stop_ids for _, s in masked])))  # fmt: skip
        pen = use[self.uses_penalties[r]]
        if len(pen):
            prow = torch.from_numpy(rows[pen]).to(self.device)
            lp.penalty_rows = to(pen)
            lp.output_counts = self.output_counts[prow].to(device)  # [R, V]
            lp.prompt_mask = self.prompt_mask[prow].to(device)
            lp.presence, lp.frequency = to(self.presence_penalty[rows[pen]]), to(self.frequency_penalty[rows[pen]])
            lp.repetition = to(self.repetition_penalty[rows[pen]])
        if (self.min_p[r] > 0).any():
            lp.min_p = to(self.min_p[rows])
        return lp


def _check_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """A row's token ids index [rows, V] tensors in the batched sampler: one out of range would fail the whole step,
    so it fails the request here, alone (admission checks them first; this is the runner's own guard)."""
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} {sorted(set(ids[(ids < 0) | (ids >= vocab_size)].tolist()))[:5]} are outside the "
                         f"vocabulary [0, {vocab_size})")  # fmt: skip
