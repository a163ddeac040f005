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
Each forward gets an AttentionMetadata: where to write the new K/V (slot_mapping) and,
for decode, where every sequence's earlier K/V are (block_tables, context_lens).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from roseinfer.attention import TORCH_BACKEND, AttentionBackend, AttentionMetadata, get_backend
from roseinfer.block_manager import BlockSpaceManager
from roseinfer.checks import check_engine_args, check_kv_pool
from roseinfer.detokenizer import Detokenizer
from roseinfer.kv_cache import KVCache
from roseinfer.loader import load_model, pick_device, pick_dtype
from roseinfer.sampling import SamplingParams, sample
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
    ):
        check_engine_args(use_kv_cache, block_size, num_blocks, kv_cache_memory, gpu_memory_utilization,
                          attention_backend)  # fmt: skip
        self.use_kv_cache = use_kv_cache
        self.block_size, self.num_blocks, self.kv_cache_memory = block_size, num_blocks, kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.attn_backend = get_backend(attention_backend, self.device)  # 'auto': triton on CUDA, torch on CPU
        self.model, self.model_dir = load_model(model, self.device, self.dtype)
        self.config = self.model.config
        check_kv_pool(block_size, num_blocks, kv_cache_memory, self.config.n_positions, self.kv_bytes_per_token,
                      self.device)  # fmt: skip
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir, self.config.vocab_size)
        self.eos_token_id = self.config.eos_token_id  # what transformers' generate stops on (None: never)
        # a pool for one sequence, used by the single-request path (token_stream, stream, generate)
        self.solo_block_manager = BlockSpaceManager(block_size, -(-self.config.n_positions // block_size))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 · n_layer · n_embd · bytes per element."""
        return 2 * self.config.n_layer * self.config.n_embd * self.dtype.itemsize

    def make_block_manager(self) -> BlockSpaceManager:
        """A block manager for a KV pool of `num_blocks`; else of `kv_cache_memory` bytes; else, on
        CUDA, of what fits in `gpu_memory_utilization` of the card; else 256 MiB."""
        return BlockSpaceManager(
            self.block_size, self.num_blocks, kv_cache_memory=self._kv_budget(), bytes_per_token=self.kv_bytes_per_token
        )

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
            bm.kv_cache = KVCache(self.config, bm.num_blocks, bm.block_size, self.dtype, self.device)
        return block_manager.kv_cache

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
        """Advance one unfinished session by one token and return it (single-request path)."""
        bm = self.solo_block_manager
        if session.request_id not in bm.block_tables:
            for old in list(bm.block_tables):  # one session at a time: drop anything abandoned
                bm.free(old)
            bm.allocate(session.request_id, session.num_tokens)
        else:
            bm.append_slot(session.request_id)
        self.step_sessions([session], bm)
        if session.finished:
            bm.free(session.request_id)
        return session.output_ids[-1]

    @torch.inference_mode()
    def step_sessions(self, sessions: list[InferenceSession], block_manager: BlockSpaceManager) -> None:
        """Advance unfinished sessions by one token each. Their KV slots must already be booked in
        `block_manager` (the scheduler does that): blocks for the whole sequence at prefill,
        one more slot per decode.

        New (or preempted) sessions are prefilled one by one; every decoding session goes through
        ONE batched forward that reads its K/V from the paged pool. Then the whole [B, V] batch of
        logits is sampled at once, each row with its own SamplingParams and generator.
        """
        if not sessions:
            return
        if not self.use_kv_cache:  # naive: the whole sequence again, one session at a time
            rows = [
                self.model(torch.tensor([s.prompt_ids + s.output_ids], device=self.device))[:, -1] for s in sessions
            ]
            order = sessions
        else:
            pool = self.kv_cache_for(block_manager).layers
            prefills = [s for s in sessions if s.num_computed_tokens == 0]
            decodes = [s for s in sessions if s.num_computed_tokens > 0]
            rows = [self._prefill(s, block_manager, pool) for s in prefills]
            if decodes:
                rows.append(self._decode(decodes, block_manager, pool))
            order = prefills + decodes
        logits = torch.cat(rows)  # [B, V]
        next_ids = sample(logits, [s.params for s in order], [s.generator for s in order]).tolist()
        for session, token_id in zip(order, next_ids, strict=True):
            session.append_token(token_id)

    def _prefill(self, session: InferenceSession, bm: BlockSpaceManager, pool) -> torch.Tensor:
        """Run the whole sequence once, writing its K/V into the pool. Returns the last logits [1, V].

        For a new request that is the prompt; for a preempted one, prompt + the tokens it had generated."""
        tokens = session.prompt_ids + session.output_ids
        meta = prefill_metadata(session, bm, self.device, self.attn_backend)
        logits = self.model(torch.tensor([tokens], device=self.device), None, pool, meta)  # [1, T, V]
        session.num_computed_tokens = len(tokens)
        return logits[:, -1]

    def _decode(self, sessions: list[InferenceSession], bm: BlockSpaceManager, pool) -> torch.Tensor:
        """One batched forward for the newest token of every session. Returns logits [B, V].

        No padding and no copies of the cache: each row only needs its block table.

            seq 0: pos 37, table [7, 2, 9]   -> new K/V go to slot 9·16 + 5, attend to 38 tokens
            seq 1: pos 15, table [4]         -> slot 4·16 + 15, attend to 16 tokens
        """
        meta = decode_metadata(sessions, bm, self.device, self.attn_backend)
        positions = (meta.context_lens - 1).long()[:, None]  # the newest token's position, per row: [B, 1]
        tokens = torch.tensor([[s.last_token_id] for s in sessions], device=self.device)  # [B, 1]
        logits = self.model(tokens, positions, pool, meta)  # [B, 1, V]
        for s in sessions:
            s.num_computed_tokens = s.num_tokens
        return logits[:, -1]

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


# ---- attention metadata (vLLM's names) -------------------------------------------------
def prefill_metadata(
    session: InferenceSession, bm: BlockSpaceManager, device: torch.device, backend: AttentionBackend = TORCH_BACKEND
) -> AttentionMetadata:
    """One slot per token of the sequence, in order."""
    slots = [bm.slot(session.request_id, pos) for pos in range(session.num_tokens)]
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor(slots, device=device), backend=backend)


def decode_metadata(
    sessions: list[InferenceSession],
    bm: BlockSpaceManager,
    device: torch.device,
    backend: AttentionBackend = TORCH_BACKEND,
) -> AttentionMetadata:
    """Decode: the newest token of each sequence is at position num_tokens - 1.

    slot_mapping  [B]              where its K/V go: table[pos // bs] * bs + pos % bs
    block_tables  [B, max_blocks]  each row's physical blocks, padded with 0 (never read)
    context_lens  [B]              pos + 1 tokens to attend to
    """
    ids = [s.request_id for s in sessions]
    positions = [s.num_tokens - 1 for s in sessions]
    tables = [bm.block_tables[i] for i in ids]
    width = max(map(len, tables))
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor([bm.slot(i, p) for i, p in zip(ids, positions, strict=True)], device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
        backend=backend,
    )
