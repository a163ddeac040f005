"""Checks for the constructors' arguments: a bad one fails at once with an error that names it.

A wrong type is a TypeError, a wrong value a ValueError, and the message says what is allowed.
Two Python traps are closed on purpose: `True` is an int (so `block_size=True` would be a
block of one token) and `float("nan")` fails every comparison (so `not x < 0` lets it through);
both are refused wherever a number is expected, and so is infinity.
"""

from __future__ import annotations

import os

import torch


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(name: str, value, low: int = 1, none_ok: bool = False) -> None:
    """An int >= low (or None, if allowed)."""
    allowed = f"an int >= {low}" + (" or None" if none_ok else "")
    if value is None and none_ok:
        return
    if not is_int(value):
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_fraction(name: str, value) -> None:
    """A finite number in (0, 1]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number in (0, 1], got {value!r} ({type(value).__name__})")
    if not 0 < value <= 1:  # written this way round, nan (False for every comparison) is refused too
        raise ValueError(f"{name} must be a number in (0, 1], got {value}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


PREEMPTION_MODES = (None, "recompute", "swap")  # vLLM's: None = recompute one sequence, swap several


def check_swap_args(watermark, preemption_mode, swap_space) -> None:
    """Stage 12: the watermark is a fraction of the pool in [0, 1), swap_space GiB >= 0 that the host has."""
    for name, value, high, allowed in (("watermark", watermark, 1, "a number in [0, 1)"),
                                       ("swap_space", swap_space, float("inf"), "a finite number >= 0")):  # fmt: skip
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
        if not 0 <= value < high:  # nan fails both comparisons: refused
            raise ValueError(f"{name} must be {allowed}, got {value}")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be None, 'recompute' or 'swap', got {preemption_mode!r}")
    total = _memory_bytes(torch.device("cpu"))
    if total is not None and swap_space * 2**30 > total:
        raise ValueError(f"swap_space={swap_space} GiB is more than the host's {total / 2**30:.1f} GiB of memory")


def check_engine_args(use_kv_cache, block_size, num_blocks, kv_cache_memory, gpu_memory_utilization,
                      attention_backend) -> None:  # fmt: skip
    """InferenceEngine's arguments, before anything is loaded."""
    check_bool("use_kv_cache", use_kv_cache)
    check_int("block_size", block_size)
    check_int("num_blocks", num_blocks, none_ok=True)
    check_int("kv_cache_memory", kv_cache_memory, none_ok=True)
    check_fraction("gpu_memory_utilization", gpu_memory_utilization)
    if not isinstance(attention_backend, str):
        raise TypeError(f"attention_backend must be 'auto', 'torch' or 'triton', got {attention_backend!r}")


def check_kv_pool(block_size: int, num_blocks: int | None, kv_cache_memory: int | None, n_positions: int,
                  bytes_per_token: int, device: torch.device) -> None:  # fmt: skip
    """Once the model is known: a block fits in the context, and the KV pool asked for fits in memory."""
    if block_size > n_positions:
        raise ValueError(f"block_size must be <= the model's context (n_positions={n_positions}), got {block_size}")
    block = block_size * bytes_per_token
    if kv_cache_memory is not None and kv_cache_memory < block:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no KV block "
                         f"(one block of {block_size} tokens needs {block} bytes)")  # fmt: skip
    total = _memory_bytes(device)
    for name, value, need in (("num_blocks", num_blocks, (num_blocks or 0) * block),
                              ("kv_cache_memory", kv_cache_memory, kv_cache_memory or 0)):  # fmt: skip
        if total is not None and need > total:
            raise ValueError(f"{name}={value} asks for a {need / 2**30:.1f} GiB KV cache, but the {device.type} "
                             f"device has {total / 2**30:.1f} GiB of memory in all")  # fmt: skip


def _memory_bytes(device: torch.device) -> int | None:
    """All of the device's memory (None if we cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None


def check_tensor_parallel(tp_size, device: torch.device, use_kv_cache: bool) -> int:
    """Stage 15: tensor_parallel_size is an int in [1, the devices there are]: CUDA cards, or CPU cores (each
    rank needs at least one core to itself, or the ranks wait on each other at every all-reduce)."""
    check_int("tensor_parallel_size", tp_size)
    if device.type == "cuda":
        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(), "CPU cores"
    if tp_size > have:
        raise ValueError(f"tensor_parallel_size={tp_size} needs one {what[:-1]} per rank, but this machine has {have}")
    if tp_size > 1 and not use_kv_cache:
        raise ValueError("tensor_parallel_size > 1 runs the paged forward only: use_kv_cache must be True")
    return tp_size


def check_tensor_parallel_shapes(n_head: int, inner: int, tp_size: int) -> None:
    """Stage 15: every rank gets whole attention heads and an equal slice of the MLP."""
    if n_head % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's n_head={n_head} "
                         f"(each rank holds n_head / tensor_parallel_size whole heads)")  # fmt: skip
    if inner % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's MLP width {inner}")
