"""Which PyTorch ops take an engine's time? torch.profiler over `LLM.generate`, the ops with the most time of
their own (chapter 18).

    python benchmarks/engine/profile_ops.py --model smollm2-135m --threads 2 --json results/18-llama-family/ops.json

32 requests (token-id prompts of 16 to 128 random ids, seed 0), 64 greedy tokens each, max_num_seqs 32, a 4 GiB
KV pool. `--model` takes what scripts/benchmark.py takes (a directory, or gpt2 / smollm2-135m for random weights);
`--dtype` the weights' and KV cache's dtype (float32 unless given). The run is timed once without the profiler
(tok/s), then profiled twice:

    run      the timed run's work again, the prefix cache emptied first: every prompt's prefill, then the decode
             steps (`ops_run` in the JSON)
    decode   the same requests once more, their prompts now held by the prefix cache, so each prefill computes
             one token and the profile is almost all decode steps (`ops` in the JSON: what this script profiled
             before it had the `run` column, so earlier data files are of this kind)

An op's share in `decode` is its share of a decode step; in `run`, of the whole workload.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks import benchmark  # resolve_model: the same random-weight shapes
from benchmarks.common import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile

    from roseinfer import LLM, SamplingParams

    model_dir = benchmark.resolve_model(args.model, benchmark.REPO / ".cache" / "random-models")
    llm = LLM(str(model_dir), device="cpu", dtype=args.dtype, max_num_seqs=32, kv_cache_memory=4 * 2**30)
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()  # the warm-up's prompts: not cached for the timed run
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    tok_s = 32 * 64 / (time.perf_counter() - t0)
    profiles = {}
    for name in ("run", "decode"):
        if name == "run":
            llm.llm_engine.reset_prefix_cache()  # the timed run's prefills again
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        profiles[name] = op_rows(prof.key_averages())
    print(f"{args.model}, {args.dtype}, {args.threads} threads: {tok_s:.1f} tok/s without the profiler")
    top = [r["op"] for r in profiles["run"][: args.top]]
    top += [r["op"] for r in profiles["decode"][: args.top] if r["op"] not in top]
    by_op = {name: {r["op"]: r for r in rows} for name, rows in profiles.items()}
    print(f"{'':<36} {'run (prefill + decode)':>30} {'decode (prompts cached)':>30}")
    print((f"{'op':<36} " + f"{'share':>8} {'self ms':>10} {'calls':>10} " * 2).rstrip())
    for op in top:
        cells = [by_op[name].get(op, dict(share=0.0, self_ms=0.0, calls=0)) for name in ("run", "decode")]
        print(f"{op:<36} " + " ".join(f"{c['share']:>8.1%} {c['self_ms']:>10.1f} {c['calls']:>10}" for c in cells))
    if args.json:
        out = dict(model=args.model, dtype=args.dtype, threads=args.threads, tok_s=tok_s)
        out.update(ops=profiles["decode"][: args.top], ops_run=profiles["run"][: args.top])
        write_json(args.json, out)


def op_rows(events) -> list[dict]:
    """Ops by the time they spent themselves, most first, each with its share of all ops' own time."""
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    return [dict(op=e.key, share=e.self_cpu_time_total / total, self_ms=e.self_cpu_time_total / 1e3, calls=e.count)
            for e in ops]  # fmt: skip


if __name__ == "__main__":
    main()
