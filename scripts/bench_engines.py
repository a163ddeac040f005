"""The engines scripts/benchmark.py compares: each runner takes (workload, model_dir, device, dtype,
batch_size) and returns (per-request output token ids, seconds), or (ids, seconds, extras) where
extras is a dict of what else it measured (roseinfer: time to first token, prefix-cache counters).

    roseinfer            LLMEngine (what LLM.generate runs), every request added at once
    roseinfer-nocache    the same with enable_prefix_caching=False (stage 10)
    hf-generate          GPT2LMHeadModel.generate on left-padded static batches of batch_size
    hf-cb                transformers' continuous batching (generate_batch's manager)
    dense-limit          a bare decode loop of the same weights: the ceiling (scripts/dense_limit.py)
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch
from dense_limit import run_dense_limit


def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_roseinfer(wl, model_dir: Path, device, dtype, batch_size: int, enable_prefix_caching: bool = True):
    """Every request added to one LLMEngine at once, then steps until all are done (LLM.generate's loop,
    written out here to time each request's first token)."""
    from roseinfer import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device=str(device), dtype=dtype, max_num_seqs=batch_size,
              enable_prefix_caching=enable_prefix_caching)  # fmt: skip
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5]], [params(2), params(2)], use_tqdm=False)  # warm-up
    engine, first, done = llm.llm_engine, {}, {}
    engine.reset_prefix_cache()  # nothing from the warm-up may be hit
    before = engine.get_stats()
    sync(device)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        engine.add_request(str(i), prompt, params(n))
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    sync(device)
    secs = time.perf_counter() - t0
    extras = {"ttft_p50_s": statistics.median(first.values())}
    after = engine.get_stats()  # the timed run's own prefix-cache lookups and hits (the warm-up's are not counted)
    extras |= {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}
    return [done[str(i)] for i in range(len(wl.prompts))], secs, extras


def run_roseinfer_nocache(wl, model_dir: Path, device, dtype, batch_size: int):
    return run_roseinfer(wl, model_dir, device, dtype, batch_size, enable_prefix_caching=False)


@torch.no_grad()
def run_hf_generate(wl, model_dir: Path, device, dtype, batch_size: int):
    model = load_hf(model_dir, device, dtype)
    eos = model.config.eos_token_id

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        width = max(map(len, prompts))  # left padding: every prompt ends at column `width`
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # min_new_tokens == max_new_tokens suppresses EOS, so every row runs exactly `new` steps
        greedy = dict(do_sample=False, pad_token_id=eos, eos_token_id=eos)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **greedy)
        return out[:, width:].tolist()

    generate([[1, 2, 3], [4, 5]], 2)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(wl.prompts), batch_size):
        lens = wl.output_lens[i : i + batch_size]
        rows = generate(wl.prompts[i : i + batch_size], max(lens))  # the batch runs to its longest output ...
        results += [row[:n] for row, n in zip(rows, lens, strict=True)]  # ... but only the requested tokens count
    sync(device)
    return results, time.perf_counter() - t0


def cb_config_for(wl, batch_size: int):
    """An explicit ContinuousBatchingConfig: without num_blocks / max_batch_tokens, transformers sizes the KV cache
    from free memory (60% of RAM on CPU, 90% of free GPU memory)."""
    from transformers import ContinuousBatchingConfig

    page = 64
    concurrent = min(batch_size, len(wl.prompts))
    longest = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens, strict=True))
    blocks = concurrent * math.ceil(longest / page)
    margin = 0.15  # the FIFO scheduler stops admitting prefills when less than this fraction of blocks is free
    return ContinuousBatchingConfig(
        page_size=page,  # tokens per block (`block_size` is the deprecated name)
        num_blocks=math.ceil(blocks / (1 - margin)) + 1,
        max_batch_tokens=min(2048, concurrent * (max(map(len, wl.prompts)) + 1)),  # tokens per step (prefill + decode)
        max_requests_per_batch=concurrent,
        safety_margin=margin,
        allow_block_sharing=wl.params.get("shared_prefix", 0) > 0,  # HF's prefix caching, where prompts share one
        seed=wl.params["seed"],
    )


@torch.no_grad()
def run_hf_cb(wl, model_dir: Path, device, dtype, batch_size: int):
    from transformers import GenerationConfig

    model = load_hf(model_dir, device, dtype)
    # `generate_batch(inputs, generation_config, continuous_batching_config=...)` takes one max_new_tokens for all
    # requests, so we use the context manager it wraps and pass per-request max_new_tokens and eos_token_id=-1
    # (no EOS) to `manager.add_request`; results are GenerationOutput objects with `.generated_tokens`.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1)

    def run(manager, prompts: list[list[int]], lens: list[int], tag: str) -> list[list[int]]:
        ids = [
            manager.add_request(p, request_id=f"{tag}_{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
        ]
        done = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = out.generated_tokens if out.error is None else []
            elif out is None and not manager.is_running():
                print("hf-cb: generation thread died", file=sys.stderr)
                break
        return [done.get(i, []) for i in ids]

    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_config_for(wl, batch_size), block=True, timeout=30
    ) as manager:
        run(manager, [[1, 2, 3], [4, 5]], [2, 2], "warmup")
        sync(device)
        t0 = time.perf_counter()
        results = run(manager, wl.prompts, wl.output_lens, "req")
        sync(device)
        elapsed = time.perf_counter() - t0
    return results, elapsed


ENGINES = {
    "roseinfer": run_roseinfer,
    "roseinfer-nocache": run_roseinfer_nocache,
    "hf-generate": run_hf_generate,
    "hf-cb": run_hf_cb,
    "dense-limit": run_dense_limit,
}
DEFAULT_ENGINES = ["roseinfer", "hf-generate", "hf-cb", "dense-limit"]
