"""The public offline API, shaped like vLLM's:

    from roseinfer import LLM, SamplingParams
    llm = LLM()                                   # the bundled model; or a path / Hub id
    outs = llm.generate(["Romeo.\\n", "Hamlet.\\n"], SamplingParams(temperature=0.8, max_tokens=64))
    print(outs[0].text)

From this stage on the signature stays put; later stages only change what runs inside.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from roseinfer.llm_engine import LLMEngine
from roseinfer.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from roseinfer.sampling import BeamSearchParams, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        preemption_mode: str | None = None,
        swap_space: float = 4,
        speculative_config: dict | None = None,
        tensor_parallel_size: int = 1,
    ):
        """`block_size`, `num_blocks` / `kv_cache_memory` (bytes; CPU default 256 MiB) /
        `gpu_memory_utilization` (CUDA) size the KV pool; `max_num_seqs` caps how many
        requests run together and `max_num_batched_tokens` how many tokens one step computes
        (default 2048), with long prompts cut into chunks if `enable_chunked_prefill`; with
        `enable_prefix_caching` prompts that start alike share the K/V blocks of that start.
        `attention_backend`: 'auto' (triton on CUDA, sdpa on CPU), 'torch', 'sdpa' or 'triton'.
        Preemption when the pool runs out: `preemption_mode` None (recompute a request with one sequence,
        swap one with several), 'recompute' or 'swap', into a host pool of `swap_space` GiB; admission
        keeps a `watermark` fraction of the pool free. `speculative_config` (vLLM's keys) turns on
        speculative decoding: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}.
        `tensor_parallel_size` (stage 15): split every layer across that many processes (gloo on CPU, NCCL
        on CUDA); `close()`, `with LLM(...) as llm:`, garbage collection or exit stop them."""
        self.llm_engine = LLMEngine(
            model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
            watermark=watermark, preemption_mode=preemption_mode, swap_space=swap_space,
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip
        self.engine = self.llm_engine.engine
        self.tokenizer = self.llm_engine.tokenizer
        self.block_manager = self.llm_engine.block_manager

    def close(self) -> None:
        """Stop the tensor-parallel workers (stage 15); a no-op with one process."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string or a list of token ids (a list of prompts may mix both; an empty list
        gives an empty list back). `sampling_params` is one SamplingParams for all prompts or a list
        with one per prompt. Invalid input raises before anything runs.
        Runs on LLMEngine: continuous batching with at most `max_num_seqs` requests at a time.
        """
        prompts = _as_prompt_list(prompts)
        return self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (stage 11): per prompt, the `beam_width` best finished sequences,
        best first, the same as Hugging Face `generate(num_beams=beam_width, num_return_sequences=beam_width,
        do_sample=False, early_stopping=True, length_penalty=...)`. The beams run on LLMEngine like any
        request: they fork and share KV blocks, and copy a shared block before writing into it."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        lp = params.length_penalty
        return [
            BeamSearchOutput([BeamSearchSequence(c.token_ids, c.text, c.cumulative_logprob,
                                                 c.cumulative_logprob / len(c.token_ids) ** lp) for c in out.outputs])
            for out in self._run(prompts, [params] * len(prompts), use_tqdm)
        ]  # fmt: skip

    def _run(self, prompts: list[Prompt], params: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(i) for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                try:
                    engine.add_request(rid, prompt, p)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from e
            t0, n_out = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    n_out += 1
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                bar.set_postfix_str(f"{n_out / (time.perf_counter() - t0):.1f} output tok/s", refresh=False)
        finally:
            bar.close()
            for rid in ids:  # after an error: abort whatever is left, so no block leaks
                if rid in engine.sessions:
                    engine.abort_request(rid)
        return [results[r] for r in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # a single prompt
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    return list(prompts)  # [] -> no requests, [] back (as vLLM and HF pipelines do)


def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt)")
    return params
