"""The public offline API, shaped like vLLM's:

    from roseinfer import LLM, SamplingParams
    llm = LLM()                                   # the bundled model; or a path / Hub id
    outs = llm.generate(["Romeo.\\n", "Hamlet.\\n"], SamplingParams(temperature=0.8, max_tokens=64))
    print(outs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi!"}])   # a chat model: its chat template makes the prompt

`LLM(model, **kwargs)` takes `EngineArgs`' fields (roseinfer/config.py); each output is built once, when its
request finishes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.entrypoints import chat_utils
from roseinfer.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from roseinfer.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        """`model`: a directory or Hub id (None: the bundled model). The keyword arguments are `EngineArgs`'
        (roseinfer/config.py, vLLM's names): `block_size`, `num_blocks` / `kv_cache_memory` (bytes; CPU default
        256 MiB) / `gpu_memory_utilization` (CUDA) size the KV pool; `max_num_seqs` caps how many sequences run
        together and `max_num_batched_tokens` how many tokens one step computes (default 2048), with long
        prompts cut into chunks if `enable_chunked_prefill`; with `enable_prefix_caching` prompts that start
        alike share the K/V blocks of that start. `attention_backend`: 'auto' (triton on CUDA, cpu on a CPU),
        'torch', 'sdpa', 'cpu' or 'triton'. Preemption when the pool runs out: `preemption_mode` None (recompute a
        request with one sequence, swap one with several), 'recompute' or 'swap', into a host pool of
        `swap_space` GiB; admission keeps a `watermark` fraction of the pool free. `speculative_config` (vLLM's
        keys) turns on speculative decoding: {"method": "ngram" | "draft_model", "num_speculative_tokens": k,
        ...}. `tensor_parallel_size`: split every layer across that many processes (gloo on CPU, NCCL on CUDA);
        `close()`, `with LLM(...) as llm:`, garbage collection or exit stop them. `enforce_eager` (CUDA): no
        CUDA graphs. `custom_ops`: how a Llama layer's small ops (RMSNorm, RoPE, SiLU·up) run: 'auto' (the fused
        C++ or Triton kernel where there is one), 'native' (PyTorch) or 'compile' (torch.compile)."""
        self.llm_engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.llm_engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers; a no-op with one process."""
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
        Runs on LLMEngine: continuous batching with at most `max_num_seqs` sequences at a time. Each output is
        built once, when its request finishes (RequestOutputKind.FINAL_ONLY).
        """
        prompts = _as_prompt_list(prompts)
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _as_params_list(sampling_params, len(prompts))]  # fmt: skip
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate the next message of each conversation: `messages` is one conversation (a list of
        {"role": ..., "content": ...} dicts) or a list of them; one RequestOutput per conversation, as `generate`.

        Each conversation is rendered by the model's chat template (or `chat_template`, a Jinja template), as
        transformers' `apply_chat_template` renders it (entrypoints/chat_utils.py), and tokenized without adding
        special tokens (the template wrote the BOS if the model wants one). The token ids then run as `generate`
        runs a prompt of token ids; each output's `prompt` is the rendered text."""
        conversations = chat_utils.parse_chat_messages(messages)
        texts, prompts = [], []
        for i, conversation in enumerate(conversations):
            try:
                text, ids = chat_utils.chat_prompt_token_ids(self.tokenizer, conversation, add_generation_prompt,
                                                             chat_template)  # fmt: skip
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from e
            texts.append(text)
            prompts.append(ids)
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt: per prompt, the `beam_width` best finished sequences,
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
                    if out.finished:
                        results[out.request_id] = out
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                bar.set_postfix_str(f"{n_out / (time.perf_counter() - t0):.1f} output tok/s", refresh=False)
        finally:
            bar.close()
            for rid in ids:  # after an error: abort whatever is left, so no block leaks
                if rid in engine.output_processor.requests:
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
