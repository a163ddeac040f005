"""A launched step: its sampled tokens on their way from the device to host memory.

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

from roseinfer.core.sched.output import ModelRunnerOutput
from roseinfer.sample.logprobs import compute_logprobs
from roseinfer.sample.sampler import sample
from roseinfer.worker.input_batch import InputBatch


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
