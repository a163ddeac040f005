"""Greedy agreement in bf16: roseinfer against transformers, each in bf16, and each against fp32 (chapter 20).

    python benchmarks/engine/bf16_agreement.py --model roseinfer/models/tiny-llama-shakespeare \\
        --json results/20-fused-cpu-kernels/agreement-bf16-tiny-llama.json

The requests are scripts/benchmark.py's (`--workload`, default small: 128 prompts of random token ids, 32-128 greedy
tokens each, EOS an ordinary token). Four runs of them: roseinfer (`bench_engines.run_roseinfer`, as benchmark.py
runs it, at most 32 at a time) and transformers (each request alone with its KV cache,
`bench_engines.hf_greedy_reference`, what benchmark.py checks ids against), each in fp32 and in bf16. In fp32 the
two must be equal, request by request (the project's guarantee, checked here again). In bf16 neither is fp32: the
rounding of every product and sum differs between oneDNN's bf16 GEMMs with fp32 accumulation and transformers' bf16
ops, so the greedy ids part where two logits are closer than bf16 can tell. For each pair of runs the table gives
the requests whose ids are all equal, and "prefix": the tokens equal up to the first difference, as a share of all
generated tokens (after a difference the two runs continue different texts, so later positions are not compared).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import benchmark
from benchmarks.common import write_json
from benchmarks.engine.bench_engines import hf_greedy_reference, run_roseinfer


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests whose ids are all equal, and the share of tokens equal before each request's first difference."""
    pairs = list(zip(a, b, strict=True))
    prefix = [next((i for i, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), len(u)) for u, v in pairs]
    total = sum(map(len, a))
    equal = sum(p == len(u) for p, (u, _) in zip(prefix, pairs, strict=True))
    return {"equal_requests": equal, "requests": len(a), "prefix_share": sum(prefix) / total, "tokens": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="roseinfer/models/tiny-llama-shakespeare")
    ap.add_argument("--workload", default="small", choices=benchmark.WORKLOADS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = benchmark.resolve_model(args.model, benchmark.REPO / ".cache" / "random-models")
    cfg = json.loads((model_dir / "config.json").read_text())
    context = cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))
    wl = benchmark.make_workload(benchmark.parse_args(["--workload", args.workload]), context, cfg["vocab_size"],
                                 model_dir)  # fmt: skip
    cpu, runs = torch.device("cpu"), {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        runs[f"roseinfer {name}"] = run_roseinfer(wl, model_dir, cpu, dtype, batch_size=32)[0]
        runs[f"transformers {name}"] = hf_greedy_reference(wl, model_dir, cpu, dtype)
    rose, hf = "roseinfer", "transformers"
    pairs = [(f"{rose} float32", f"{hf} float32"), (f"{rose} bfloat16", f"{hf} bfloat16"),
             (f"{rose} bfloat16", f"{rose} float32"), (f"{hf} bfloat16", f"{hf} float32")]  # fmt: skip
    rows = [{"a": a, "b": b} | compare(runs[a], runs[b]) for a, b in pairs]
    print(f"{args.model}, workload {args.workload}: {len(wl.prompts)} requests, {rows[0]['tokens']} greedy tokens")
    print(f"{'pair':<46} {'equal requests':>15} {'prefix':>8}")
    for r in rows:
        print(f"{r['a'] + ' vs ' + r['b']:<46} {r['equal_requests']:>9} / {r['requests']:<3} {r['prefix_share']:>8.1%}")
    if args.json:
        write_json(args.json, {"model": args.model, "workload": args.workload, "pairs": rows})
    if rows[0]["equal_requests"] != rows[0]["requests"]:
        raise SystemExit("fp32: roseinfer's greedy ids differ from transformers'")


if __name__ == "__main__":
    main()
