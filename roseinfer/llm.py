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

from roseinfer.engine import InferenceEngine
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams
from roseinfer.scheduler import OfflineScheduler

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
    ):
        """`block_size`, `num_blocks` / `kv_cache_memory` (bytes) size the KV block pool."""
        self.engine = InferenceEngine(
            model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
        )  # fmt: skip
        self.tokenizer = self.engine.tokenizer
        self.block_manager = self.engine.make_block_manager()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string or a list of token ids. `sampling_params` is one SamplingParams
        for all prompts or a list with one per prompt. Invalid input raises before anything runs.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        scheduler = OfflineScheduler(self.engine, self.block_manager)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                ids.append(scheduler.add_request(prompt, p))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            t0 = time.perf_counter()
            while scheduler.has_unfinished():
                scheduler.step()
                if use_tqdm:  # finished requests, and output tokens/s so far
                    sessions = scheduler.sessions.values()
                    bar.update(sum(s.finished for s in sessions) - bar.n)
                    tok_s = sum(len(s.output_ids) for s in sessions) / (time.perf_counter() - t0)
                    bar.set_postfix_str(f"{tok_s:.1f} output tok/s", refresh=False)
        finally:
            bar.close()
            scheduler.free_all()  # normally a no-op: finished requests already gave their blocks back
        return [scheduler.sessions[r].output() for r in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # a single prompt
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return list(prompts)


def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one per prompt)")
    return params
