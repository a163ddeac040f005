"""What each stage buys: the same workload through every stage's own code, and through HF, in interleaved rounds.

    python benchmarks/engine/bench_stages.py --json results/07-paged-kv-cache/stages-rounds.json
    python benchmarks/engine/bench_stages.py --stages 01 05 08 --rounds 2 --min-seconds 2    # a quick look

Every `stage-NN-*` tag (rebuilt from the commit trailers first) is checked out into a temporary
worktree, once, and each measurement is a fresh Python process with that snapshot's `roseinfer`
first on the path, through a small adapter for the API that stage had:

    01  InferenceEngine.generate_ids, one request after another, EOS ignored (naive, no cache)
    02  InferenceEngine.token_stream, one request after another (KV cache)
    03+ LLM.generate on all requests at once (max_num_seqs where the stage has it: from 06 on; from 16 on
        LLM takes it as one of its keyword arguments, the fields of EngineArgs)

All stages use this checkout's bundled model, on the same device, with the same seeded requests
(greedy, exact output lengths). `hf-generate` and `hf-cb` come from scripts/benchmark.py, in
processes of their own like the stages.

How a shared, noisy CPU is kept out of the numbers:
- a measurement runs the whole workload again and again until --min-seconds have passed (a stage
  that finishes it in 0.3 s runs it ~30 times), after an untimed warm-up on two of its requests;
- the stages take turns: round r runs every stage once, in an order rotated by r, so a slow minute
  of the machine lands on a few stages of one round, not on every round of one stage;
- --rounds measurements per stage; the table gives the median and the range, the figure the median
  with the range as its error bar, and the JSON every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HF = ["hf-generate", "hf-cb"]
ADAPTER = r"""
import json, sys, time, inspect
from pathlib import Path
import torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"]) if spec["threads"] else None
prompts, lens, model, device, stage = spec["prompts"], spec["output_lens"], spec["model"], spec["device"], spec["stage"]
if spec.get("hf"):  # (outputs, seconds) from scripts/benchmark.py's engine, which times its own generation
    from benchmarks import benchmark as bench
    dtype = torch.float32 if device == "cpu" else torch.float16
    engine = bench.ENGINES[spec["hf"]]
    go = lambda ps, ns: engine(bench.Workload({"seed": 0}, ps, ns), Path(model), torch.device(device), dtype,
                               spec["batch_size"])[:2]
else:
    if stage == 1:
        from roseinfer import InferenceEngine
        eng = InferenceEngine(model, device=device)
        eng.eos_token_id = -1  # stage 01 has no ignore_eos: never stop early
        run = lambda ps, ns: [eng.generate_ids(p, max_new_tokens=n) for p, n in zip(ps, ns)]
    elif stage == 2:
        from roseinfer import InferenceEngine, SamplingParams
        eng = InferenceEngine(model, device=device)
        sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        run = lambda ps, ns: [list(eng.token_stream(p, sp(n))) for p, n in zip(ps, ns)]
    else:
        from roseinfer import LLM, SamplingParams
        ps_ = inspect.signature(LLM).parameters  # 03-05: no max_num_seqs; 06-15: a parameter; 16+: an EngineArgs kwarg
        takes = "max_num_seqs" in ps_ or any(p.kind is p.VAR_KEYWORD for p in ps_.values())
        llm = LLM(model=model, device=device, **({"max_num_seqs": spec["batch_size"]} if takes else {}))
        sps = lambda ns: [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ns]
        run = lambda ps, ns: [o.token_ids for o in llm.generate(ps, sps(ns), use_tqdm=False)]

    def go(ps, ns):
        t0 = time.perf_counter()
        outs = run(ps, ns)
        if device == "cuda":
            torch.cuda.synchronize()
        return outs, time.perf_counter() - t0
go(prompts[:2], lens[:2])  # warm-up, untimed
seconds, passes, exact = 0.0, 0, True
while passes == 0 or seconds < spec["min_seconds"]:
    outs, s = go(prompts, lens)
    seconds, passes, exact = seconds + s, passes + 1, exact and [len(o) for o in outs] == lens
print(json.dumps({"seconds": seconds, "passes": passes, "tokens": passes * sum(lens), "exact": exact}))
"""


def stage_tags() -> list[str]:
    subprocess.run([str(REPO / "scripts" / "tag_stages.sh")], check=True, capture_output=True)
    out = subprocess.run(["git", "tag", "--list", "stage-*"], cwd=REPO, check=True, capture_output=True, text=True)
    return sorted(out.stdout.split())


@contextlib.contextmanager
def worktrees(tags: list[str]):
    """{tag: a temporary worktree checked out at it}, removed on the way out."""
    with tempfile.TemporaryDirectory(prefix="roseinfer-stages-") as tmp:
        made = {}
        try:
            for tag in tags:
                made[tag] = Path(tmp) / tag
                subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(made[tag]), tag], cwd=REPO,
                               check=True)  # fmt: skip
            yield made
        finally:
            for wt in made.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO, check=False)


def measure(name: str, where: Path, spec: dict) -> dict:
    """One measurement of a stage (its worktree first on the path) or an HF engine (this checkout), in a fresh
    process: {"seconds", "passes", "tokens", "exact"} plus "tok_s"."""
    env = {"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin"}
    spec = spec | {"stage": int(name.split("-")[1]) if name.startswith("stage-") else 0,
                   "hf": None if name.startswith("stage-") else name}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", ADAPTER, json.dumps(spec)], cwd=where, env=env,
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out | {"tok_s": out["tokens"] / out["seconds"]}


WIDTHS = (30, 12, 8, 8, 11, 9, 11, 14)  # the table's columns


def table(runs: dict[str, list[dict]], spec: dict, rounds: int) -> str:
    """Medians and ranges over the rounds; `vs previous` compares a stage with the stage before it round by round
    (both ran minutes apart in the same round): the median of the rounds' ratios, and in how many it was > 1."""
    med = {k: statistics.median(m["tok_s"] for m in v) for k, v in runs.items()}
    first = next((v for k, v in med.items() if k.startswith("stage-01")), None)
    hf = med.get("hf-generate")
    lines = [f"{len(spec['output_lens'])} requests, {sum(spec['output_lens'])} output tokens a pass, {spec['device']}; "
             f"{rounds} interleaved rounds, each measurement >= {spec['min_seconds']:g} s",
             f"| {'stage':30s} | {'tok/s median':>12} | {'min':>8} | {'max':>8} | {'vs previous':>11} | "
             f"{'faster in':>9} | {'vs stage 01':>11} | {'vs hf-generate':>14} |",
             "|" + "|".join("-" * 32 if w == 30 else "-" * (w + 1) + ":" for w in WIDTHS) + "|"]  # fmt: skip
    prev = None
    for k, v in med.items():
        tok = [m["tok_s"] for m in runs[k]]
        r1, rh = (f"{v / first:.2f}x" if first else "-"), (f"{v / hf:.2f}x" if hf else "-")
        vp, won = "-", "-"
        if prev and k.startswith("stage-"):
            ratios = [m["tok_s"] / p["tok_s"] for p, m in zip(runs[prev], runs[k], strict=True)]
            vp, won = f"{statistics.median(ratios):.2f}x", f"{sum(x > 1 for x in ratios)}/{len(ratios)}"
        prev = k if k.startswith("stage-") else prev
        lines.append(f"| {k:30s} | {v:12.1f} | {min(tok):8.1f} | {max(tok):8.1f} | {vp:>11} | {won:>9} | "
                     f"{r1:>11} | {rh:>14} |")  # fmt: skip
    return "\n".join(lines)


def title(n: int, device: str, rounds: int, seconds: float) -> str:
    what = f"median of {rounds} interleaved rounds of >= {seconds:g} s, bars = range"
    return f"same {n} requests, every stage's own code ({device}): {what}"


def plot(runs: dict[str, list[dict]], path: Path, heading: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    tok = [[m["tok_s"] for m in runs[k]] for k in names]
    med = [statistics.median(t) for t in tok]
    err = [[m - min(t) for m, t in zip(med, tok, strict=True)], [max(t) - m for m, t in zip(med, tok, strict=True)]]
    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    colors = ["#b5172b" if k.startswith("stage") else "#777777" for k in names]
    ax.bar(range(len(names)), med, yerr=err, capsize=2, color=colors, error_kw={"elinewidth": 0.8})
    ax.set_xticks(range(len(names)), [k.removeprefix("stage-") for k in names], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="*", help="two-digit stage numbers (default: every tag)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    ap.add_argument("--batch-size", type=int, default=16, help="max_num_seqs / the HF static batch")
    ap.add_argument("--rounds", type=int, default=5, help="measurements per stage, the stages taking turns")
    ap.add_argument("--min-seconds", type=float, default=10.0, help="each measurement repeats the workload this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=REPO / "results" / "stages.json")
    ap.add_argument("--plot", type=Path, default=REPO / "chapters" / "stage_progression.png")
    ap.add_argument("--report", type=Path, help="measure nothing: the table and figure of this earlier --json")
    args = ap.parse_args()
    if args.report:
        data = json.loads(args.report.read_text())
        print(table(data["runs"], data["spec"], data["rounds"]))
        spec = data["spec"]
        plot(
            data["runs"],
            args.plot,
            title(len(spec["output_lens"]), spec["device"], data["rounds"], spec["min_seconds"]),
        )
        return 0

    from roseinfer import DEFAULT_MODEL

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4095) for _ in range(rng.randint(*args.input_len))] for _ in range(args.num_requests)]
    lens = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    spec = {"prompts": prompts, "output_lens": lens, "model": DEFAULT_MODEL, "device": args.device,
            "batch_size": args.batch_size, "threads": args.threads, "min_seconds": args.min_seconds}  # fmt: skip
    tags = [t for t in stage_tags() if not args.stages or t.split("-")[1] in args.stages]
    names = tags + ([] if args.no_hf else HF)
    runs: dict[str, list[dict]] = {k: [] for k in names}
    with worktrees(tags) as trees:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # round r starts r names later
                m = measure(name, trees.get(name, REPO), spec)
                runs[name].append(m | {"round": r})
                print(f"round {r + 1}/{args.rounds} {name:30s} {m['tok_s']:8.1f} tok/s ({m['passes']} passes, "
                      f"{m['seconds']:.1f} s)", flush=True)  # fmt: skip
    report = table(runs, spec, args.rounds)
    print("\n" + report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"spec": {k: v for k, v in spec.items() if k != "prompts"}, "rounds": args.rounds,
                                     "runs": runs}, indent=1) + "\n")  # fmt: skip
    plot(runs, args.plot, title(args.num_requests, args.device, args.rounds, args.min_seconds))
    print(f"wrote {args.json} and {args.plot}")
    return 0 if all(m["exact"] for v in runs.values() for m in v) else 1


if __name__ == "__main__":
    raise SystemExit(main())
