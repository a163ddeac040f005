"""One configuration for the whole engine, checked in one place before anything is loaded.

    LLM(model, max_num_seqs=8, ...)  ─┐
    LLMEngine(model, ...)            ─┼─► EngineArgs (the flat keyword arguments, vLLM's names)
    roseinfer serve --max-num-seqs 8 ─┘        │  create_engine_config(): every check, config.json read
                                               ▼
    EngineConfig ─ model_config      model directory, its config (registry.py), device, dtypes, backends, context
                 ─ cache_config      block size, KV pool size (blocks or bytes), prefix caching, swap space
                 ─ scheduler_config  sequences and tokens per step, chunked prefill, preemption
                 ─ parallel_config   tensor-parallel ranks
                 ─ speculative_config  (None, or the proposer and its k)

`EngineArgs` is what a user writes; its fields also make the command line's flags (`--max-num-seqs`),
so a new argument is added once. `EngineConfig` is what the engine reads: resolved (the model's
directory found, `device="auto"` decided, the token budget's default filled in) and consistent (the
block fits the context, the pool fits the memory, the heads split across the ranks). A bad value is a
TypeError or ValueError naming the argument, raised before a weight is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

import torch

from roseinfer.attention import resolve_backend_name
from roseinfer.attention.fp8_kv import pick_kv_cache_dtype
from roseinfer.checks import check_bool, check_int, check_number, is_int
from roseinfer.model_executor.custom_op import check_impl
from roseinfer.model_executor.onednn_linear import LINEAR_BACKENDS, resolve_linear_backend
from roseinfer.model_executor.registry import ModelConfigType

DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes of K/V on a CPU when neither num_blocks nor kv_cache_memory is given
PREEMPTION_MODES = (None, "recompute", "swap")  # vLLM's: None = recompute one sequence, swap several
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "cpu", "triton")
SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding with vLLM's keys. `num_speculative_tokens` is k, the drafts proposed per request
    per step. ngram: the n-gram length tried first (`prompt_lookup_max`, default 5) down to the shortest
    (`prompt_lookup_min`, default 1); draft_model: `model`, a directory (or hub id) of a GPT-2 with the
    target's vocabulary."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys are {sorted(known)}")
        if missing := [key for key in ("method", "num_speculative_tokens") if key not in config]:
            raise ValueError(f"speculative_config needs {missing[0]!r}")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's path")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = 1 if lo is None else lo
            hi = max(5, lo) if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not is_int(v) or v < 1:
                    raise ValueError(f"{name} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its tokens for the proposer's own forwards: a draft model writes the
        K/V of its guesses into the request's blocks (the same table as the target's); n-gram writes nothing."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass
class ModelConfig:
    model_dir: Path
    hf_config: ModelConfigType
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "torch" | "sdpa" | "cpu" | "triton" (never "auto": decided for the device)
    linear_backend: str = "aten"  # "dense" | "onednn" | "aten" (never "auto": decided for the device and dtype)
    max_model_len: int = 0  # the context the engine serves: the model's, or less (0: the model's)
    custom_ops: str = "auto"  # "auto" | "native" | "compile": how the layers' small ops run (custom_op.py)
    kv_cache_dtype: torch.dtype | None = None  # the KV pool's: None = dtype; float8_e4m3fn for "fp8" (fp8_kv.py)

    def __post_init__(self) -> None:
        self.max_model_len = self.max_model_len or self.hf_config.max_position_embeddings
        self.kv_cache_dtype = self.kv_cache_dtype or self.dtype

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_config.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: eos_token_id first, then generation_config.json's others."""
        return self.hf_config.eos_token_ids

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """K and V, every layer: 2 · layers · K/V heads · head_dim · bytes per element of the pool (1 for an fp8
        cache); on each of `tp_size` ranks, / tp_size. Grouped-query attention stores num_key_value_heads heads."""
        c = self.hf_config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.kv_cache_dtype.itemsize // tp_size


@dataclass
class CacheConfig:
    block_size: int
    num_gpu_blocks: int | None  # the device pool; None until the runner has measured it (CUDA, no num_blocks)
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    watermark: float
    swap_space: float  # GiB of host memory for swapped-out blocks
    num_cpu_blocks: int  # swap_space in blocks


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    preemption_mode: str | None
    max_model_len: int
    num_lookahead_tokens: int = 0  # speculative decoding with a draft model: KV slots booked past each decode
    async_scheduling: bool = False  # schedule step t + 1 while step t runs (one token in flight per request)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs
    warmup: bool = False  # CPU: build the oneDNN kernels of every step size at start-up (roseinfer/worker/warm_up.py)

    def with_num_gpu_blocks(self, num_blocks: int) -> EngineConfig:
        """The final config, once the model runner has decided the KV pool's blocks: a copy that holds them (this
        config is not changed). The engine core builds the KV cache manager and the scheduler from it."""
        check_int("num_gpu_blocks", num_blocks)
        return replace(self, cache_config=replace(self.cache_config, num_gpu_blocks=num_blocks))


def _arg(default, help: str, **cli):
    """An EngineArgs field: its default, its help text (the CLI's too), and extra argparse settings."""
    kw = {"default_factory": default} if callable(default) and not isinstance(default, type) else {"default": default}
    return field(**kw, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """Every argument of `LLM`, `LLMEngine` and `roseinfer serve`, with vLLM's names and defaults."""

    model: str | os.PathLike | None = _arg(None, "model directory or Hub id (default: the bundled model)")
    device: str | torch.device = _arg("auto", "'auto' (CUDA if there is one), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str | torch.dtype | None = _arg(None, "float32 | float16 | bfloat16 (default: fp32 on CPU, fp16 on CUDA)")
    block_size: int = _arg(16, "tokens per KV block")
    kv_cache_dtype: str = _arg("auto", "the KV cache's: 'auto' (the model's dtype) or 'fp8' (e4m3, 1 byte an element)")
    num_blocks: int | None = _arg(None, "KV blocks in the pool (default: from kv_cache_memory)")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV pool (CPU default 256 MiB)")
    gpu_memory_utilization: float = _arg(0.9, "CUDA: the share of the card the weights and the KV pool may take")
    max_num_seqs: int = _arg(64, "sequences that run together at most")
    max_num_batched_tokens: int | None = _arg(None, "tokens one step computes at most (default 2048)")
    attention_backend: str = _arg("auto", "'auto' (triton on CUDA, cpu on a CPU), 'torch', 'sdpa', 'cpu' or 'triton'")
    linear_backend: str = _arg("auto", "'auto' (dense, else onednn, on a CPU; else aten), 'dense', 'onednn', 'aten'",
                               choices=list(LINEAR_BACKENDS))  # fmt: skip
    custom_ops: str = _arg("auto", "RMSNorm, RoPE, SiLU·up: 'auto' (fused C++/Triton), 'native' or 'compile'")
    enable_chunked_prefill: bool = _arg(True, "cut long prompts into chunks that fit the token budget")
    enable_prefix_caching: bool = _arg(True, "prompts that start alike share the KV blocks of that start")
    watermark: float = _arg(0.01, "share of the KV pool that admitting a request must leave free")
    preemption_mode: str | None = _arg(None, "'recompute' or 'swap' (default: recompute one sequence, swap several)",
                                       choices=["recompute", "swap"])  # fmt: skip
    swap_space: float = _arg(4, "GiB of host memory for swapped-out KV blocks")
    speculative_config: dict | SpeculativeConfig | None = _arg(
        None, """speculative decoding, as JSON: '{"method": "ngram", "num_speculative_tokens": 4}'""", type=json.loads
    )
    max_model_len: int | None = _arg(None, "the longest sequence (prompt + output) served (default: the model's)")
    tensor_parallel_size: int = _arg(1, "processes that share the model, 1/N of every layer each")
    enforce_eager: bool = _arg(False, "CUDA: run every step eagerly (no CUDA graphs)")
    async_scheduling: bool = _arg(False, "schedule the next step while the GPU runs this one")
    warmup: bool = _arg(False, "CPU: build every step size's oneDNN kernels at start-up, so memory stays flat")

    def create_engine_config(self) -> EngineConfig:
        """Check every argument (types first, then what needs the model's config.json), resolve the defaults."""
        check_int("block_size", self.block_size)
        check_int("num_blocks", self.num_blocks, none_ok=True)
        check_int("kv_cache_memory", self.kv_cache_memory, none_ok=True)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, "a number in (0, 1]", low_open=True)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, none_ok=True)
        check_int("max_model_len", self.max_model_len, none_ok=True)
        if not isinstance(self.attention_backend, str):
            raise TypeError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check_impl(self.custom_ops)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "async_scheduling", "warmup"):
            check_bool(name, getattr(self, name))
        check_number("watermark", self.watermark, 0, 1, "a number in [0, 1)")
        check_number("swap_space", self.swap_space, 0, float("inf"), "a finite number >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}")
        spec = SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config is not None else None
        if spec is not None and self.async_scheduling:
            raise ValueError("async_scheduling does not work with speculative_config: drafts are proposed from the "
                             "tokens of the step before, which async scheduling has not seen yet")  # fmt: skip
        host = memory_bytes(torch.device("cpu"))
        if host is not None and self.swap_space * 2**30 > host:
            raise ValueError(f"swap_space={self.swap_space} GiB is more than the host's {host / 2**30:.1f} GiB of "
                             "memory")  # fmt: skip
        device = pick_device(self.device)
        dtype, kv = pick_dtype(self.dtype, device), pick_kv_cache_dtype(self.kv_cache_dtype)  # kv None: dtype's
        backend = resolve_backend_name(self.attention_backend, device)
        linear_backend = resolve_linear_backend(self.linear_backend, device, dtype)
        tp = check_tensor_parallel(self.tensor_parallel_size, device)
        from roseinfer.model_executor.loader import read_model_config, resolve_model_dir

        model_dir = resolve_model_dir(self.model)
        hf = read_model_config(model_dir)
        max_len = check_max_model_len(self.max_model_len, hf)
        model_config = ModelConfig(model_dir, hf, device, dtype, backend, linear_backend, max_len, self.custom_ops, kv)
        check_tensor_parallel_shapes(hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size, tp)
        bytes_per_token = model_config.kv_bytes_per_token(tp)
        check_kv_pool(self.block_size, self.num_blocks, self.kv_cache_memory, max_len, bytes_per_token, device)
        num_blocks = self.num_blocks
        if num_blocks is None and (self.kv_cache_memory or device.type != "cuda"):
            num_blocks = (self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // (bytes_per_token * self.block_size)
        cache = CacheConfig(self.block_size, num_blocks, self.kv_cache_memory, self.gpu_memory_utilization,
                            self.enable_prefix_caching, self.watermark, self.swap_space,
                            int(self.swap_space * 2**30) // (bytes_per_token * self.block_size))  # fmt: skip
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        if not self.enable_chunked_prefill and budget < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than the model's context ({max_len}): "
                f"without chunked prefill a long prompt could never be scheduled; raise max_num_batched_tokens "
                f"or set enable_chunked_prefill=True"
            )
        lookahead = spec.num_lookahead_tokens if spec is not None else 0
        sched = SchedulerConfig(self.max_num_seqs, budget, self.enable_chunked_prefill, self.preemption_mode,
                                max_len, lookahead, self.async_scheduling)  # fmt: skip
        return EngineConfig(model_config, cache, sched, ParallelConfig(tp), spec, self.enforce_eager, self.warmup)

    @classmethod
    def add_cli_args(cls, parser, defaults: dict | None = None) -> None:
        """One `--flag` per field (dashes for underscores); booleans that default to True get `--no-...`.
        `defaults`: the command's own defaults where they differ (`roseinfer serve` warms up)."""
        for f in fields(cls):
            flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
            default = (defaults or {}).get(f.name, f.default if f.default is not MISSING else None)
            if isinstance(default, bool):
                name = f"--no-{f.name.replace('_', '-')}" if default else flag
                parser.add_argument(name, dest=f.name, action="store_false" if default else "store_true",
                                    help=meta["help"])  # fmt: skip
                continue
            kind = meta.pop("type", None) or {"int": int, "float": float}.get(f.type.split(" |")[0], str)  # annotation
            parser.add_argument(flag, type=kind, default=default, **meta)

    @classmethod
    def from_cli_args(cls, args) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# ---- the checks that need more than a type ---------------------------------------------------------------
def pick_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' (CUDA if torch sees a GPU, else CPU), 'cpu', 'cuda', 'cuda:N' or a torch.device."""
    allowed = "'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be {allowed}, got {device!r} ({type(device).__name__})")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be {allowed}, got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be {allowed} (roseinfer runs on CPU and CUDA), got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return device


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> float32 on CPU, float16 on CUDA. Strings like 'bfloat16' or 'fp16' work too."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type (float32, float16, bfloat16), got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, a torch.dtype or None, got {dtype!r} ({type(dtype).__name__})")
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


def check_max_model_len(max_model_len: int | None, hf: ModelConfigType) -> int:
    """The context served: the model's (max_position_embeddings), or a shorter one asked for. A model whose
    attention only looks back `sliding_window` tokens (Mistral) runs only within that window: roseinfer
    attends to the whole context, which equals sliding-window attention exactly while no sequence is longer."""
    limit = hf.max_position_embeddings
    if max_model_len is not None and not 1 <= max_model_len <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                         f"got {max_model_len}")  # fmt: skip
    served = max_model_len or limit
    window = hf.sliding_window
    if window is not None and window < served:
        raise ValueError(f"the model's sliding_window={window} is shorter than the context served ({served}): "
                         f"sliding-window attention is not implemented; pass max_model_len <= {window}")  # fmt: skip
    return served


def check_kv_pool(block_size: int, num_blocks: int | None, kv_cache_memory: int | None, max_model_len: int,
                  bytes_per_token: int, device: torch.device) -> None:  # fmt: skip
    """A block fits in the context, and the KV pool asked for fits in memory."""
    if block_size > max_model_len:
        raise ValueError(f"block_size must be <= the model's context (max_model_len={max_model_len}), "
                         f"got {block_size}")  # fmt: skip
    block = block_size * bytes_per_token
    if kv_cache_memory is not None and kv_cache_memory < block:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no KV block "
                         f"(one block of {block_size} tokens needs {block} bytes)")  # fmt: skip
    total = memory_bytes(device)
    for name, value, need in (("num_blocks", num_blocks, (num_blocks or 0) * block),
                              ("kv_cache_memory", kv_cache_memory, kv_cache_memory or 0)):  # fmt: skip
        if total is not None and need > total:
            raise ValueError(f"{name}={value} asks for a {need / 2**30:.1f} GiB KV cache, but the {device.type} "
                             f"device has {total / 2**30:.1f} GiB of memory in all")  # fmt: skip


def memory_bytes(device: torch.device) -> int | None:
    """All of the device's memory (None if we cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None


def check_tensor_parallel(tp_size, device: torch.device) -> int:
    """tensor_parallel_size is an int in [1, the devices there are]: CUDA cards, or CPU cores (each rank needs
    at least one core to itself, or the ranks wait on each other at every all-reduce)."""
    check_int("tensor_parallel_size", tp_size)
    if device.type == "cuda":
        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(), "CPU cores"
    if tp_size > have:
        raise ValueError(f"tensor_parallel_size={tp_size} needs one {what[:-1]} per rank, but this machine has {have}")
    return tp_size


def check_tensor_parallel_shapes(n_head: int, n_kv_head: int, inner: int, tp_size: int) -> None:
    """Every rank gets whole attention heads, whole K/V heads and an equal slice of the MLP."""
    if n_head % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's num_attention_heads={n_head} "
                         f"(each rank holds num_attention_heads / tensor_parallel_size whole heads)")  # fmt: skip
    if n_kv_head % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's num_key_value_heads={n_kv_head} "
                         f"(each rank holds whole K/V heads and the query heads that read them)")  # fmt: skip
    if inner % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's MLP width {inner}")
