"""One step's tensors: its inputs, built from the persistent batch with a handful of numpy operations, and its
sampled tokens on their way back (`StepHandle`).

Every request's new tokens this step are laid end to end, decodes first, as one flat batch (no padding,
no [B, T] rectangle):

    request          A (decode)  B (decode)  C (prompt chunk: tokens 32..79 of 100)
    input_ids        a37         b15         c32 c33 ... c79                       [N] = [50]
    positions        37          15          32  33  ... 79                        [N]
    slot_mapping     A's slot    B's slot    C's slots for positions 32..79        [N]
    query_start_loc  [0, 1, 2, 50]           request b's rows: query_start_loc[b] .. [b + 1] - 1
    seq_lens         [38, 16, 80]            tokens each request attends to after this step
    block_tables     [B, W]                  the step's rows of the block table, W = blocks of the longest

Each line is one vectorised expression over the rows of the step's requests: positions are
`arange(N)` shifted per request, input ids one fancy-index into the token array, slots one into the
block table. Decodes come first, longest context first (the sdpa backend batches runs of similar
length); then prompt chunks and verifications (a request checking k drafts brings 1 + k rows). A token's slot
is block_id * block_size + offset, its block read from the step's rows of the table.

The sampled tokens of a launched step:

    launch_step   sample on the device ─► copy the tokens to pinned host memory (non-blocking) ─► record an event
    (the host schedules the next step meanwhile: async scheduling)
    finish_step   wait for the event ─► write the tokens into the batch ─► ModelRunnerOutput

On a CPU there is nothing to wait for: the tokens are the sampler's own tensor, and there is no event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.attention import AttentionBackend, AttentionMetadata, GatherBuffer
from roseinfer.core.sched.output import ModelRunnerOutput
from roseinfer.sample.logprobs import compute_logprobs
from roseinfer.sample.sampler import sample
from roseinfer.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    req_ids: list[str]  # the step's requests, in batch order
    rows: np.ndarray  # [B] their rows in the input batch
    counts: np.ndarray  # [B] new tokens of each
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    attn_metadata: AttentionMetadata


def prepare_step(
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    backend: AttentionBackend,
    gather_buffer: GatherBuffer,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> StepInputs:
    """The forward's inputs for `counts[i]` new tokens of each request, from position `starts[i]` on (its
    num_computed_tokens, for the target model)."""
    seq_lens = starts + counts
    order = np.lexsort((-seq_lens, counts > 1))  # decodes first, then the rest; longest first within each
    if (order[1:] < order[:-1]).any():  # (most decode steps are in order already)
        rows, counts, starts, seq_lens = rows[order], counts[order], starts[order], seq_lens[order]
        req_ids = [req_ids[i] for i in order]
    B = len(rows)
    query_start_loc = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    N = int(query_start_loc[-1])
    req_of_token = np.repeat(np.arange(B), counts)  # [N]
    positions = np.arange(N) + np.repeat(starts - query_start_loc[:-1], counts)  # [N]
    input_ids = batch.token_ids[rows[req_of_token], positions]  # [N]
    bs = batch.block_table.block_size
    width = int(-(-seq_lens.max() // bs))
    block_tables = batch.block_table.table[rows, :width]  # [B, W]
    slot_mapping = block_tables[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs  # [N]
    qsl_cpu, lens_cpu = query_start_loc.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping),
        query_start_loc=to_device(query_start_loc.astype(np.int32)),
        seq_lens=to_device(seq_lens.astype(np.int32)),
        block_tables=to_device(block_tables),
        num_decodes=int(np.count_nonzero(counts == 1)),
        max_query_len=int(counts.max()),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=lens_cpu,
        backend=backend,
        gather_buffer=gather_buffer,
    )
    if backend.prepare is not None:
        meta.plan = backend.prepare(meta, bs)  # once per step, for every layer
    return StepInputs(req_ids, rows, counts, query_start_loc, seq_lens, to_device(input_ids), to_device(positions),
                      meta)  # fmt: skip


@dataclass
class StepHandle:
    """A launched step: its output so far, and the plain rows' tokens (maybe still landing in host memory)."""

    out: ModelRunnerOutput
    plain: np.ndarray  # indices into out.req_ids of the requests that sampled one token
    rows: np.ndarray  # their rows in the input batch
    tokens: torch.Tensor | None  # [P] int64 on the host
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)
    logprobs: tuple | None = None  # (which of the plain rows, their N, host tensors of compute_logprobs)


def sample_plain(input_batch: InputBatch, logits: torch.Tensor, rows: np.ndarray, handle: StepHandle,
                 to_device: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """One token per row from the sampler, on their way to the host (with the event that says they are there);
    the log-probabilities of the requests that want them (logprobs, or n > 1), from the raw logits. Returns the
    tokens on the device."""
    sampling = input_batch.sampling_tensors(rows, logits.device)
    want = np.flatnonzero(input_batch.num_logprobs[rows] >= 0) if input_batch.num_logprob_rows else ()
    raw = logits[to_device(want)] if len(want) else None  # a copy: the processors change logits in place
    tokens = sample(logits, sampling)  # [S]
    logprobs = None
    if raw is not None:
        nums = input_batch.num_logprobs[rows[want]]
        logprobs = compute_logprobs(raw, tokens[to_device(want)], int(nums.max()))
    if tokens.device.type == "cpu":
        handle.tokens = tokens
        handle.logprobs = None if logprobs is None else (want, nums, logprobs)
        return tokens
    handle.tokens = to_host(tokens)  # the host does other work while this lands
    handle.logprobs = None if logprobs is None else (want, nums, tuple(to_host(x) for x in logprobs))
    handle.event = torch.cuda.Event()
    handle.event.record()
    return tokens


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory, on its way (non-blocking)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
