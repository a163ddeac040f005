"""The inference engine: turn a prompt into a continuation, one token at a time.

Naive loop (stage 01, still here with use_kv_cache=False): every step feeds the *whole*
sequence through the model and keeps only the last position's logits:

    step 1:  [p0 p1 p2]          -> t3
    step 2:  [p0 p1 p2 t3]       -> t4      (work grows with length: O(n²) overall)

KV cache (stage 02): one `prefill` over the prompt keeps every layer's keys and values;
each `decode_step` then feeds only the newest token, at its exact position:

    prefill:  [p0 p1 p2]  -> t3, cache K/V(p0..p2)
    decode:   [t3] @ pos 3 -> t4, cache += K/V(t3)
    decode:   [t4] @ pos 4 -> t5, cache += K/V(t4)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch.nn.utils.rnn import pad_sequence

from roseinfer.block_manager import BlockSpaceManager
from roseinfer.detokenizer import Detokenizer
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
    ):
        self.use_kv_cache = use_kv_cache
        self.block_size, self.num_blocks, self.kv_cache_memory = block_size, num_blocks, kv_cache_memory
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.model, self.model_dir = load_model(model, self.device, self.dtype)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir, self.config.vocab_size)
        self.eos_token_id = self.tokenizer.eos_token_id

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 · n_layer · n_embd · bytes per element."""
        return 2 * self.config.n_layer * self.config.n_embd * self.dtype.itemsize

    def make_block_manager(self) -> BlockSpaceManager:
        """A block manager sized by `num_blocks`, or by `kv_cache_memory` bytes (default 256 MiB)."""
        return BlockSpaceManager(
            self.block_size,
            self.num_blocks,
            kv_cache_memory=self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY,
            bytes_per_token=self.kv_bytes_per_token,
        )

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
        """Advance one unfinished session by one token and return it."""
        self.step_sessions([session])
        return session.output_ids[-1]

    @torch.inference_mode()
    def step_sessions(self, sessions: list[InferenceSession]) -> None:
        """Advance unfinished sessions by one token each.

        New sessions are prefilled one by one (prompts differ in length); every session that
        is already decoding goes through ONE batched forward. Then the whole [B, V] batch of
        logits is sampled at once, each row with its own SamplingParams and generator.
        """
        if not self.use_kv_cache:  # naive: the whole sequence again, one session at a time
            rows = [
                self.model(torch.tensor([s.prompt_ids + s.output_ids], device=self.device))[:, -1] for s in sessions
            ]
            order = sessions
        else:
            prefills = [s for s in sessions if s.kv_cache is None]
            decodes = [s for s in sessions if s.kv_cache is not None]
            rows = [self._prefill(s) for s in prefills]
            if decodes:
                rows.append(self._decode_batch(decodes))
            order = prefills + decodes
        if not order:
            return
        logits = torch.cat(rows)  # [B, V]
        next_ids = sample(logits, [s.params for s in order], [s.generator for s in order]).tolist()
        for session, token_id in zip(order, next_ids, strict=True):
            session.append_token(token_id)

    def _prefill(self, session: InferenceSession) -> torch.Tensor:
        """The whole prompt once; keep its K/V. Returns the last position's logits [1, V]."""
        logits, session.kv_cache = self.model.prefill(torch.tensor([session.prompt_ids], device=self.device))
        return logits[:, -1]

    def _decode_batch(self, sessions: list[InferenceSession]) -> torch.Tensor:
        """One batched forward for the newest token of every session. Returns logits [B, V].

        Caches have different lengths L_i, so we pad them to L = max L_i (right padding),
        mask the padding out, and give every row its own position id L_i (not L!):

            row 0: k0 k1 k2 ·  ·  | new      mask 1 1 1 0 0 1   position 3
            row 1: k0 k1 k2 k3 k4 | new      mask 1 1 1 1 1 1   position 5
        """
        lens = torch.tensor([s.num_tokens - 1 for s in sessions], device=self.device)  # cached tokens L_i: [B]
        L = int(lens.max())
        tokens = torch.tensor([s.last_token_id for s in sessions], device=self.device)  # [B]
        slots = torch.arange(L + 1, device=self.device)  # [L + 1]
        attn_mask = (slots[None, :] < lens[:, None]) | (slots[None, :] == L)  # [B, L + 1]
        past = []
        for layer in range(self.config.n_layer):  # stack: pad each session's [1, H, L_i, D] to [B, H, L, D]
            k, v = (
                pad_sequence([s.kv_cache[layer][j][0].transpose(0, 1) for s in sessions], batch_first=True).transpose(
                    1, 2
                )  # [B, L, H, D] -> [B, H, L, D]
                for j in (0, 1)
            )
            past.append((k, v))
        logits, new_kv = self.model.decode_step(tokens, lens, past, attn_mask)
        for i, s in enumerate(sessions):  # split: keep each row's real keys plus the new one
            n = int(lens[i])
            s.kv_cache = [
                (torch.cat([k[i : i + 1, :, :n], k[i : i + 1, :, L:]], dim=2),
                 torch.cat([v[i : i + 1, :, :n], v[i : i + 1, :, L:]], dim=2))
                for k, v in new_kv
            ]  # fmt: skip
        return logits

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
