"""What oneDNN's primitives cost, and what building them all at start-up (`warmup=True`) buys.

    python benchmarks/engine/onednn_primitives.py --threads 2 --json primitives.json
    python benchmarks/engine/onednn_primitives.py --model-dir smollm2-135m --threads 2

oneDNN writes a line for every primitive it builds when `ONEDNN_VERBOSE=profile_create` is set
(`create:cache_miss`). For each of `warmup=False` and `warmup=True` this starts an engine in a process of its own
(on the allocator `roseinfer serve` would preload; `linear_backend="onednn"`, which a CPU without the dense GEMM
gets by default), then serves `--rounds` rounds of `--prompts` prompts of random
lengths (5 to `--max-prompt` tokens, a new seed each round) and counts, from that log:

    at start       seconds to build the engine, its resident memory (VmRSS), inner-product primitives built
    each round     primitives built while serving, and the resident memory after the round

Without a warm-up the primitives come with the rounds (a new row count, a new primitive); with one they are all
built before the first request. The memory a primitive keeps is the difference in resident memory at start
divided by the difference in primitives. The JSON (--json) holds every number and the command line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import REPO, cpu_model, server_env
from benchmarks.serving.serving_model import model_dir
from roseinfer.entrypoints.allocator import find_allocator

CHILD = """
import json, random, sys, time
import torch
from roseinfer import LLM, SamplingParams
warmup, threads, rounds, prompts, max_prompt, model = sys.argv[1:7]
torch.set_num_threads(int(threads))
def rss():
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
t0 = time.perf_counter()
llm = LLM(model or None, warmup=warmup == "1", linear_backend="onednn")
print(json.dumps({"phase": "start", "s": time.perf_counter() - t0, "rss_mib": rss()}), flush=True)
for r in range(int(rounds)):
    rng = random.Random(r)
    batch = [[rng.randrange(1000) for _ in range(rng.randrange(5, int(max_prompt)))] for _ in range(int(prompts))]
    llm.generate(batch, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print(json.dumps({"phase": f"round {r + 1}", "rss_mib": rss()}), flush=True)
"""
MISS = "create:cache_miss,cpu,inner_product"


def run(warmup: bool, args) -> dict:
    """One engine in its own process: the phases it printed, each with the primitives built since the last."""
    env = server_env({"ONEDNN_VERBOSE": "profile_create"})
    found = find_allocator("auto")
    if found is not None:
        env["LD_PRELOAD"] = found[1]
    model = str(args.model_dir or "")
    argv = [str(int(warmup)), str(args.threads), str(args.rounds), str(args.prompts), str(args.max_prompt), model]
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, check=True,
                         cwd=REPO).stdout  # fmt: skip
    phases, built = [], 0
    for line in out.splitlines():
        if MISS in line:
            built += 1
        elif line.startswith('{"phase"'):
            phases.append({**json.loads(line), "primitives_built": built})
            built = 0
    return {"warmup": warmup, "allocator": found[0] if found else "system", "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-dir",
        type=model_dir,
        default=None,
        help="a directory, or smollm2-135m (serving_model.py); default: the bundled model",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # the C++ ops are built the first time a process needs them (in a fresh TORCH_EXTENSIONS_DIR: a minute), not
    # by a measured start
    subprocess.run([sys.executable, "-c", "from roseinfer import custom_ops; custom_ops.available()"], check=True,
                   cwd=REPO, env=server_env())  # fmt: skip
    runs = [run(False, args), run(True, args)]
    print(f"{'warmup':<8} {'phase':<9} {'seconds':>8} {'RSS MiB':>8} {'primitives built':>17}")
    for r in runs:
        for p in r["phases"]:
            s = f"{p['s']:.2f}" if "s" in p else ""
            print(f"{str(r['warmup']):<8} {p['phase']:<9} {s:>8} {p['rss_mib']:>8.1f} {p['primitives_built']:>17}")
    cold, warm = runs[0]["phases"][0], runs[1]["phases"][0]
    per = (warm["rss_mib"] - cold["rss_mib"]) / max(1, warm["primitives_built"] - cold["primitives_built"])
    print(f"memory a primitive keeps: {per:.2f} MiB (start, warm-up minus none, per extra primitive)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "cpu": cpu_model(), "runs": runs, "mib_per_primitive": per}, f, indent=1)


if __name__ == "__main__":
    main()
