"""What each stage buys: the same workload through every stage's own code, and through HF.

    python benchmarks/engine/bench_stages.py                      # all stage tags, writes results/ and the plot
    python benchmarks/engine/bench_stages.py --stages 01 05 08 --repeat 1

Every `stage-NN-*` tag (rebuilt from the commit trailers first) is checked out into a temporary
worktree and run in a fresh Python process with that snapshot's `roseinfer` first on the path,
through a small adapter for the API that stage had:

    01  InferenceEngine.generate_ids, one request after another, EOS ignored (naive, no cache)
    02  InferenceEngine.token_stream, one request after another (KV cache)
    03+ LLM.generate on all requests at once (max_num_seqs where the stage has it: from 06 on; from 16 on
        LLM takes it as one of its keyword arguments, the fields of EngineArgs)

All stages use this checkout's bundled model, on the same device, with the same seeded
requests (greedy, exact output lengths). `hf-generate` and `hf-cb` come from
scripts/benchmark.py. Each measurement is repeated and the median is kept, because a shared
CPU is noisy. Output: a table, results/stages.json, and the bar chart for the README.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADAPTER = r"""
import json, sys, time, inspect
import torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"]) if spec["threads"] else None
prompts, lens, model, device, stage = spec["prompts"], spec["output_lens"], spec["model"], spec["device"], spec["stage"]
if stage == 1:
    from roseinfer import InferenceEngine
    eng = InferenceEngine(model, device=device)
    eng.eos_token_id = -1  # stage 01 has no ignore_eos: never stop early
    run = lambda: [eng.generate_ids(p, max_new_tokens=n) for p, n in zip(prompts, lens)]
elif stage == 2:
    from roseinfer import InferenceEngine, SamplingParams
    eng = InferenceEngine(model, device=device)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    run = lambda: [list(eng.token_stream(p, sp(n))) for p, n in zip(prompts, lens)]
else:
    from roseinfer import LLM, SamplingParams
    ps = inspect.signature(LLM).parameters  # 03-05: no max_num_seqs; 06-15: a parameter; 16+: an EngineArgs kwarg
    takes = "max_num_seqs" in ps or any(p.kind is p.VAR_KEYWORD for p in ps.values())
    kw = {"max_num_seqs": spec["batch_size"]} if takes else {}
    llm = LLM(model=model, device=device, **kw)
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    run = lambda: [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
times = []
for _ in range(spec["repeat"]):
    t0 = time.perf_counter()
    outs = run()
    if device == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": times, "tokens": sum(len(o) for o in outs), "exact": [len(o) for o in outs] == lens}))
"""


def stage_tags() -> list[str]:
    subprocess.run([str(REPO / "scripts" / "tag_stages.sh")], check=True, capture_output=True)
    out = subprocess.run(["git", "tag", "--list", "stage-*"], cwd=REPO, check=True, capture_output=True, text=True)
    return sorted(out.stdout.split())


def run_stage(tag: str, spec: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"roseinfer-{tag}-") as tmp:
        wt = Path(tmp) / "wt"
        subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(wt), tag], cwd=REPO, check=True)
        try:
            env = {"PYTHONPATH": str(wt), "PATH": "/usr/bin:/bin"}
            r = subprocess.run([sys.executable, "-c", ADAPTER, json.dumps(spec)], cwd=wt, env=env,
                               capture_output=True, text=True)  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO, check=True)
    if r.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_hf(spec: dict, engines: list[str]) -> dict:
    import torch

    from benchmarks import benchmark as bench

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    wl = bench.Workload({"seed": spec["seed"]}, spec["prompts"], spec["output_lens"])
    device, dtype = torch.device(spec["device"]), torch.float32 if spec["device"] == "cpu" else torch.float16
    out = {}
    for name in engines:
        times = []
        for _ in range(spec["repeat"]):
            outs, secs, *_ = bench.ENGINES[name](wl, Path(spec["model"]), device, dtype, spec["batch_size"])
            times.append(secs)
        out[name] = {"seconds": times, "tokens": sum(len(o) for o in outs),
                     "exact": [len(o) for o in outs] == spec["output_lens"]}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="*", help="two-digit stage numbers (default: every tag)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    ap.add_argument("--batch-size", type=int, default=16, help="max_num_seqs / the HF static batch")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=REPO / "results" / "stages.json")
    ap.add_argument("--plot", type=Path, default=REPO / "chapters" / "stage_progression.png")
    args = ap.parse_args()

    from roseinfer import DEFAULT_MODEL

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4095) for _ in range(rng.randint(*args.input_len))] for _ in range(args.num_requests)]
    lens = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    spec = {"prompts": prompts, "output_lens": lens, "model": DEFAULT_MODEL, "device": args.device, "seed": args.seed,
            "repeat": args.repeat, "batch_size": args.batch_size, "threads": args.threads}  # fmt: skip
    tags = [t for t in stage_tags() if not args.stages or t.split("-")[1] in args.stages]
    rows = {}
    for tag in tags:
        spec["stage"] = int(tag.split("-")[1])
        rows[tag] = run_stage(tag, spec)
        print(f"{tag:32s} {sum(lens) / statistics.median(rows[tag]['seconds']):8.1f} tok/s", flush=True)
    if not args.no_hf:
        for name, r in run_hf(spec, ["hf-generate", "hf-cb"]).items():
            rows[name] = r
            print(f"{name:32s} {sum(lens) / statistics.median(r['seconds']):8.1f} tok/s", flush=True)

    tok_s = {k: sum(lens) / statistics.median(r["seconds"]) for k, r in rows.items()}
    first = next((v for k, v in tok_s.items() if k.startswith("stage-01")), None)
    hf = tok_s.get("hf-generate")
    print(f"\n{args.num_requests} requests, {sum(lens)} output tokens, median of {args.repeat} runs, {args.device}")
    print(f"| {'stage':30s} | {'output tok/s':>12} | {'vs stage 01':>11} | {'vs hf-generate':>14} |")
    print(f"|{'-' * 32}|{'-' * 14}:|{'-' * 13}:|{'-' * 16}:|")
    for k, v in tok_s.items():
        r1 = f"{v / first:.2f}x" if first else "-"
        rh = f"{v / hf:.2f}x" if hf else "-"
        print(f"| {k:30s} | {v:12.1f} | {r1:>11} | {rh:>14} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"spec": {k: v for k, v in spec.items() if k != "prompts"}, "runs": rows,
                                     "output_tokens_per_s": tok_s}, indent=1) + "\n")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = [k.removeprefix("stage-") for k in tok_s]
    colors = ["#b5172b" if k.startswith("stage") else "#777777" for k in tok_s]
    ax.bar(range(len(names)), list(tok_s.values()), color=colors)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"same {args.num_requests} requests, every stage's own code ({args.device}, median of {args.repeat})")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.json} and {args.plot}")
    return 0 if all(r["exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
