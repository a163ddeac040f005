"""How much of what decode attention gathers is real tokens? (chapter 09, section 3.6)

    python benchmarks/engine/decode_fill.py --stage 09    # stage 09's code, checked out into a temporary worktree

The CPU attention backend gathers each decode row's KV blocks into one padded `[B, H, L, D]` buffer per SDPA
call, so every row in a call pays for as many blocks as the call's longest row. `decode_runs` cuts the rows,
sorted longest first, into runs of similar length. This script runs the stage's own `scripts/benchmark.py`
small workload (128 requests, greedy, exact output lengths) through the stage's roseinfer with `decode_runs`
wrapped, and for every step with decodes counts

    real       the blocks the rows hold                           sum over rows of ceil(len / block_size)
    one call   what a single call would gather                    rows x the longest row's blocks
    runs       what the runs gather, and how many calls they make  sum over runs of rows x the run's blocks

then prints real / gathered for both, and the mean number of SDPA calls per layer (every layer runs the same
plan). The scheduler and the workload are deterministic, so one run gives the numbers; threads do not change
them. The warm-up's two tiny requests are counted too. It needs stage 09's layout (`run_roseinfer` in
scripts/benchmark.py); later stages moved the engines to scripts/bench_engines.py, and from stage 17 on
decodes on a CPU read the paged cache in place and gather nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def count_step(seq_lens: list[int], block_size: int, runs: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """(rows, blocks they hold, blocks one call would gather, blocks the runs gather, calls) for one step."""
    blocks = [-(-n // block_size) for n in seq_lens]
    gathered = sum((b - a) * width for a, b, width in runs)
    return len(blocks), sum(blocks), len(blocks) * max(blocks), gathered, len(runs)


def measure(code: Path) -> dict:
    """Run the small workload through the roseinfer in `code` and count what decode attention gathers. The
    process runs with PYTHONPATH=CODE:CODE/scripts (as `in_stage` starts it), so `benchmark` is that code's."""
    import benchmark  # that code's scripts/benchmark.py
    import torch

    if not hasattr(benchmark, "run_roseinfer"):
        raise SystemExit(f"{code}: scripts/benchmark.py has no run_roseinfer (stage 09's layout)")

    from roseinfer import DEFAULT_MODEL
    from roseinfer.attention import sdpa

    steps = []  # (rows, real blocks, one-call blocks, run blocks, calls) per step with decodes
    original = sdpa.decode_runs

    def counting(seq_lens: list[int], block_size: int) -> list[tuple[int, int, int]]:
        runs = original(seq_lens, block_size)
        if runs:
            steps.append(count_step(seq_lens, block_size, runs))
        return runs

    sdpa.decode_runs = counting
    args = benchmark.parse_args(["--workload", "small"])
    model_dir = benchmark.resolve_model(DEFAULT_MODEL, args.cache_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    wl = benchmark.make_workload(args, cfg.get("n_positions", 1024), cfg["vocab_size"], model_dir)
    benchmark.run_roseinfer(wl, model_dir, torch.device("cpu"), torch.float32, args.batch_size)
    real, one, split = (sum(s[i] for s in steps) for i in (1, 2, 3))
    return {
        "workload": wl.params["name"],
        "requests": len(wl.prompts),
        "decode_steps": len(steps),
        "mean_rows": sum(s[0] for s in steps) / len(steps),
        "real_blocks": real,
        "one_call_blocks": one,
        "run_blocks": split,
        "one_call_fill": real / one,
        "runs_fill": real / split,
        "calls_per_layer": sum(s[4] for s in steps) / len(steps),
    }


def in_stage(number: str) -> dict:
    """`measure` on a stage's code: its commit in a temporary worktree, in a fresh process."""
    from tools.chapters.doc import stage_commits
    from tools.chapters.outputs import Stages

    commits = stage_commits()
    name = next((s for s in commits if s.startswith(f"{number}-")), None)
    if name is None:
        raise SystemExit(f"no stage {number}")
    stages = Stages(commits, None)
    try:
        wt = stages.checkout(number)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(wt), str(wt / "scripts")])}
        r = subprocess.run([sys.executable, __file__, "--code", str(wt), "--json-only"], cwd=wt, env=env,
                           capture_output=True, text=True)  # fmt: skip
    finally:
        stages.close()
    if r.returncode != 0:
        raise SystemExit(f"stage {number} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"code": f"stage-{name}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="09", help="a stage number (default: 09)")
    ap.add_argument("--code", type=Path, help=argparse.SUPPRESS)  # the worktree, in the child process
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    m = measure(args.code) | {"code": str(args.code)} if args.code else in_stage(args.stage)
    if args.json_only:
        print(json.dumps(m))
        return 0
    print(f"# {m['workload']} workload, {m['requests']} requests, roseinfer from {m['code']}")
    print(f"decode steps                 {m['decode_steps']:>8,}   (mean {m['mean_rows']:.1f} rows)")
    print(f"blocks holding real tokens   {m['real_blocks']:>8,}")
    print(f"gathered, one call per layer {m['one_call_blocks']:>8,}   {m['one_call_fill']:6.1%} real")
    print(f"gathered, decode_runs        {m['run_blocks']:>8,}   {m['runs_fill']:6.1%} real")
    print(f"SDPA calls per layer         {m['calls_per_layer']:>8.2f}   (one call: 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
