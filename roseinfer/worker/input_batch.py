"""The persistent input batch: the model runner's own state for every request it has seen, as array rows.

A request gets a row when the runner first sees it and keeps it until the scheduler says it finished
(preempted requests keep theirs: their tokens are still needed). Each row holds

    token_ids [rows, max_model_len]  int64   prompt + generated ids; the runner writes each token it samples,
                                             so the scheduler never sends token ids back (only the ones the
                                             runner could not know: a beam search's choices)
    num_tokens, num_computed_tokens [rows]
    block table [rows, max_blocks]           roseinfer/worker/block_table.py
    temperature, top_k, top_p, max_tokens    the sampling parameters as numbers, gathered per step into the
                                             sampler's columns (roseinfer/sample/sampler.py)

A step then works on whole columns: the rows of the scheduled requests are one index array, and every
per-token array of the forward (input ids, positions, slots) is one vectorised numpy expression over
them. Nothing per step costs Python work that grows with a request's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.sample.sampler import SamplingTensors
from roseinfer.sampling_params import SAMPLING_EPS, BeamSearchParams, SamplingParams
from roseinfer.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the runner keeps of a request besides its row's numbers."""

    req_id: str
    row: int
    params: SamplingParams | BeamSearchParams
    num_prompt_tokens: int
    generator: torch.Generator | None  # its own random stream (seeded requests only)
    beam_topk: int = 0  # a beam: return its 2·beam_width most likely next tokens instead of sampling
    spec_draft_probs: torch.Tensor | None = None  # the draft model's q for the drafts it proposed [k, V]


class InputBatch:
    def __init__(self, max_model_len: int, max_blocks_per_req: int, block_size: int, vocab_size: int,
                 device: torch.device, capacity: int = 64):  # fmt: skip
        self.max_model_len, self.vocab_size, self.device = max_model_len, vocab_size, device
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
        self.beam_topk = np.zeros(capacity, dtype=np.int64)  # a beam: its 2·beam_width best tokens, no sample
        self.needs_logprobs = np.zeros(capacity, dtype=bool)  # n > 1: the log-probability of each sampled token
        self.block_table = BlockTable(capacity, max_blocks_per_req, block_size)
        self.generators: dict[int, torch.Generator] = {}  # row -> generator, seeded rows only

    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def _grow(self) -> None:
        old, new = self.capacity, 2 * self.capacity
        for name in ("token_ids", "num_tokens", "num_computed_tokens", "num_prompt_tokens", "max_tokens",
                     "temperature", "top_k", "top_p", "seeded", "beam_topk", "needs_logprobs"):  # fmt: skip
            a = getattr(self, name)
            b = np.zeros((new, *a.shape[1:]), dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self.top_p[old:] = 1.0
        self.block_table.grow(new)
        self._free_rows = list(range(new - 1, old - 1, -1)) + self._free_rows

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                    block_ids: list[int], num_computed_tokens: int, generator: torch.Generator | None,
                    ) -> CachedRequestState:  # fmt: skip
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        n = len(prompt_token_ids)
        self.token_ids[row, :n] = prompt_token_ids
        self.num_tokens[row] = self.num_prompt_tokens[row] = n
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table.set_row(row, block_ids)
        beam = isinstance(params, BeamSearchParams)
        self.max_tokens[row] = params.max_tokens
        self.temperature[row] = 0.0 if beam else params.temperature
        self.top_k[row] = self.vocab_size if beam or params.top_k < 1 else min(params.top_k, self.vocab_size)
        self.top_p[row] = 1.0 if beam else params.top_p
        self.seeded[row] = generator is not None
        if generator is not None:
            self.generators[row] = generator
        self.beam_topk[row] = 2 * params.beam_width if beam else 0
        self.needs_logprobs[row] = not beam and params.n > 1
        state = CachedRequestState(req_id, row, params, n, generator, int(self.beam_topk[row]))
        self.requests[req_id] = state
        self.req_id_to_row[req_id] = row
        return state

    def fork(self, parent_id: str, child_id: str, block_ids: list[int], generator: torch.Generator | None) -> None:
        """A child row: the parent's tokens and parameters, its own block table and random stream."""
        parent = self.requests[parent_id]
        n, computed = int(self.num_tokens[parent.row]), int(self.num_computed_tokens[parent.row])
        prompt = self.token_ids[parent.row, : parent.num_prompt_tokens].tolist()
        child = self.add_request(child_id, prompt, parent.params, block_ids, computed, generator)
        self.token_ids[child.row, :n] = self.token_ids[parent.row, :n]
        self.num_tokens[child.row] = n

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        del self.req_id_to_row[req_id]
        self.generators.pop(state.row, None)
        self.seeded[state.row] = False
        self._free_rows.append(state.row)

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

    def sampling_tensors(self, rows: np.ndarray, device: torch.device) -> SamplingTensors:
        """The sampler's columns for the rows that sample this step, in that order."""
        temp = self.temperature[rows]
        all_greedy = not (temp >= SAMPLING_EPS).any()
        if all_greedy:  # the argmax needs none of the columns
            return SamplingTensors(None, None, None, True, False, {})
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        needs_filter = not all_greedy and bool(((top_k < self.vocab_size) | (top_p < 1.0)).any())
        gens = {}
        if self.generators:
            seeded = np.flatnonzero(self.seeded[rows])
            gens = {int(i): self.generators[int(rows[i])] for i in seeded}
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return SamplingTensors(to(temp), to(top_k), to(top_p), all_greedy, needs_filter, gens)
