"""The inference engine: turn a prompt into a continuation, one token at a time.

Naive loop (stage 01, still here with use_kv_cache=False): every step feeds the *whole*
sequence through the model and keeps only the last position's logits:

    step 1:  [p0 p1 p2]          -> t3
    step 2:  [p0 p1 p2 t3]       -> t4      (work grows with length: O(n²) overall)

KV cache (stage 02): one prefill over the prompt keeps every layer's keys and values;
each decode step then feeds only the newest token, at its exact position:

    prefill:  [p0 p1 p2]  -> t3, cache K/V(p0..p2)
    decode:   [t3] @ pos 3 -> t4, cache += K/V(t3)
    decode:   [t4] @ pos 4 -> t5, cache += K/V(t4)

Paged (stage 07): the cache is one preallocated pool of blocks owned by the block manager.
Each forward gets an AttentionMetadata: where to write the new K/V (slot_mapping) and where
every sequence's earlier K/V are (block_tables).

One forward per step (stage 09): the engine no longer builds tensors. A scheduler decides what
each step computes (a `SchedulerOutput`) and a `ModelRunner` turns that into one forward pass.
Even a single request (`token_stream`, `stream`, `generate`) goes through a scheduler and a
runner of its own, so every feature is built once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from roseinfer.attention import get_backend
from roseinfer.block_manager import BlockSpaceManager
from roseinfer.checks import check_engine_args, check_kv_pool, check_tensor_parallel
from roseinfer.detokenizer import Detokenizer
from roseinfer.distributed import TensorParallelRunner, WorkerSpec
from roseinfer.kv_cache import KVCache
from roseinfer.loader import load_model, pick_device, pick_dtype
from roseinfer.model_runner import ModelRunner
from roseinfer.sampling import SamplingParams
from roseinfer.scheduler import Scheduler
from roseinfer.session import InferenceSession
from roseinfer.tokenizer import Tokenizer

DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes of K/V the block manager may hand out


class InferenceEngine:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        use_kv_cache: bool = True,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
    ):
        """`tensor_parallel_size` > 1 (stage 15): this process is rank 0 and holds one shard of the model; the
        first `make_runner` starts the other ranks (roseinfer/distributed.py). `kv_cache_memory` is per rank."""
        check_engine_args(use_kv_cache, block_size, num_blocks, kv_cache_memory, gpu_memory_utilization,
                          attention_backend)  # fmt: skip
        self.use_kv_cache = use_kv_cache
        self.block_size, self.num_blocks, self.kv_cache_memory = block_size, num_blocks, kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.attn_backend = get_backend(attention_backend, self.device)  # 'auto': triton on CUDA, sdpa on CPU
        self.tp_size = check_tensor_parallel(tensor_parallel_size, self.device, use_kv_cache)
        self.model, self.model_dir = load_model(model, self.device, self.dtype, tp_rank=0, tp_size=self.tp_size)
        self.config = self.model.config
        check_kv_pool(block_size, num_blocks, kv_cache_memory, self.config.n_positions, self.kv_bytes_per_token,
                      self.device)  # fmt: skip
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir, self.config.vocab_size)
        self.eos_token_id = self.config.eos_token_id  # what transformers' generate stops on (None: never)
        # a pool for one sequence, used by the single-request path (token_stream, stream, generate)
        self.solo_block_manager = BlockSpaceManager(block_size, -(-self.config.n_positions // block_size))
        self._solo: tuple[Scheduler, ModelRunner] | None = None  # its scheduler and runner, made on first use
        self.tp_runner: TensorParallelRunner | None = None  # stage 15: the runner that owns the other ranks

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 · n_layer · n_embd · bytes per element (stage 15: on each rank, / tp_size)."""
        return 2 * self.config.n_layer * self.config.n_embd * self.dtype.itemsize // self.tp_size

    def make_block_manager(
        self, enable_prefix_caching: bool = False, swap_space: float = 0, watermark: float = 0.0
    ) -> BlockSpaceManager:
        """A block manager for a KV pool of `num_blocks`; else of `kv_cache_memory` bytes; else, on
        CUDA, of what fits in `gpu_memory_utilization` of the card; else 256 MiB. Stage 12: a host pool
        of `swap_space` GiB for swapped-out sequences, and `watermark` (a fraction of the pool) kept free
        at admission."""
        num_cpu_blocks = int(swap_space * 2**30) // (self.kv_bytes_per_token * self.block_size)
        bm = BlockSpaceManager(self.block_size, self.num_blocks, kv_cache_memory=self._kv_budget(),
                               bytes_per_token=self.kv_bytes_per_token, enable_prefix_caching=enable_prefix_caching,
                               num_cpu_blocks=num_cpu_blocks, watermark=watermark)  # fmt: skip
        return bm

    def _kv_budget(self) -> int:
        if self.kv_cache_memory:
            return self.kv_cache_memory
        if self.device.type == "cuda":  # the card's share for us, minus what is already used (weights ...)
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total * self.gpu_memory_utilization - (total - free))
        return DEFAULT_KV_CACHE_MEMORY

    def kv_cache_for(self, block_manager: BlockSpaceManager) -> KVCache:
        """The pool behind a block manager, allocated on first use."""
        if block_manager.kv_cache is None:
            bm = block_manager
            bm.kv_cache = KVCache(self.config, bm.num_blocks, bm.block_size, self.dtype, self.device,
                                  tp_size=self.tp_size)  # fmt: skip
        return block_manager.kv_cache

    def make_runner(self, block_manager: BlockSpaceManager) -> ModelRunner:
        """A model runner over the pool behind `block_manager`."""
        bm = block_manager
        if bm.num_cpu_blocks and bm.host_kv_cache is None:  # stage 12: the swap pool, in host memory
            bm.host_kv_cache = KVCache(self.config, bm.num_cpu_blocks, bm.block_size, self.dtype, self.device,
                                       host=True, tp_size=self.tp_size)  # fmt: skip
        if self.tp_size > 1:  # stage 15: start the other ranks, with pools of the same blocks
            return self._start_tensor_parallel(bm)
        return ModelRunner(self.model, self.kv_cache_for(bm), self.attn_backend, self.device,
                           use_kv_cache=self.use_kv_cache, host_kv_cache=bm.host_kv_cache)  # fmt: skip

    def _start_tensor_parallel(self, bm: BlockSpaceManager) -> TensorParallelRunner:
        if self.tp_runner is not None:
            raise RuntimeError("a tensor-parallel engine has one model runner (LLMEngine's); the single-request "
                               "path (generate, stream) runs with tensor_parallel_size=1")  # fmt: skip
        threads = max(1, torch.get_num_threads() // self.tp_size)  # on CPU the ranks share the cores
        spec = WorkerSpec(str(self.model_dir), self.dtype, self.device.type, self.attn_backend.name, bm.block_size,
                          bm.num_blocks, bm.num_cpu_blocks, self.tp_size, threads, port=0)  # fmt: skip
        self.tp_runner = TensorParallelRunner(self.model, self.kv_cache_for(bm), self.attn_backend, self.device,
                                              bm.host_kv_cache, spec)  # fmt: skip
        return self.tp_runner

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (stage 15). Also happens on garbage collection and at exit."""
        if self.tp_runner is not None:
            self.tp_runner.close()

    # ---- input checks -------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenize (or check) a prompt and make sure there is room to generate."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty: give at least one character")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty: give at least one token id")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        else:
            raise TypeError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if len(ids) >= self.config.n_positions:
            raise ValueError(
                f"prompt is {len(ids)} tokens long but the model's context is {self.config.n_positions} "
                f"tokens; it must be shorter to leave room for at least one new token"
            )
        return ids

    # ---- sessions: one request's state, advanced one token at a time ------------------
    def new_session(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> InferenceSession:
        """Check the prompt and set up a request's state (raises ValueError/TypeError on bad input)."""
        return InferenceSession(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_ids=self.encode_prompt(prompt),
            params=params,
            generator=params.make_generator(self.device),
            detokenizer=Detokenizer(self.tokenizer, params.stop, skip_token_ids={self.eos_token_id}),
            eos_token_id=self.eos_token_id,
            max_context=self.config.n_positions,
        )

    def step_session(self, session: InferenceSession) -> int:
        """Advance one unfinished session by one token and return it (the single-request path).

        It runs on the same Scheduler and ModelRunner as everything else, over a pool that holds
        exactly one context: the first call prefills the prompt, each later call decodes a token."""
        if self._solo is None:
            budget = max(self.config.n_positions, 2048)  # a whole prompt in one step
            self._solo = (Scheduler(self.solo_block_manager, 1, budget), self.make_runner(self.solo_block_manager))
        scheduler, runner = self._solo
        if session not in scheduler.running and session not in scheduler.waiting:
            for old in [*scheduler.running, *scheduler.waiting]:  # one session at a time: drop anything abandoned
                scheduler.finish(old)
            scheduler.add(session)
        sched = scheduler.schedule()
        scheduler.update_from_output(sched, runner.execute_model(sched))
        if session.finished:
            scheduler.finish(session)
        return session.output_ids[-1]

    # ---- one request at a time ----------------------------------------------------------
    def token_stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield new token ids one by one. Ends after EOS or a stop token id (both yielded),
        `params.max_tokens`, a stop string, or when the context is full."""
        session = self.new_session("0", prompt_ids, params)
        while not session.finished:
            yield self.step_session(session)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as tokens arrive; stop strings end the stream and are not emitted."""
        session = self.new_session("0", prompt, params or SamplingParams())
        while not session.finished:
            self.step_session(session)
            if session.last_delta:
                yield session.last_delta

    def generate_ids(
        self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None
    ) -> list[int]:
        """Return the new token ids (an EOS, if produced, is the last one)."""
        return list(self.token_stream(prompt_ids, self._params(max_new_tokens, temperature, seed)))

    def generate(
        self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None, **sampling
    ) -> str:
        """Return the continuation of `prompt` as text (without the prompt and without EOS).

        Extra keyword arguments are SamplingParams fields (top_k, top_p, stop, ...)."""
        return "".join(self.stream(prompt, self._params(max_new_tokens, temperature, seed, **sampling)))

    @staticmethod
    def _params(max_new_tokens, temperature, seed, **sampling) -> SamplingParams:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed, **sampling)
