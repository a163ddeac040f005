"""How long is one engine step, and how much of it is the engine's own Python? (chapter 16)

    python benchmarks/engine/bench_engine_step.py                      # 256 requests, 1 thread, median of 3 runs
    python benchmarks/engine/bench_engine_step.py --threads 2 --runs 5
    python benchmarks/engine/bench_engine_step.py --profile            # + a cProfile table of one run's decode steps
    PYTHONPATH=../roseinfer-15 python benchmarks/engine/bench_engine_step.py   # another stage's code (a worktree)
    python benchmarks/engine/bench_engine_step.py --against ../roseinfer-15      # both, a run of each in turn

The model is so small that its forward costs little: a random GPT-2 with one layer, two heads and 64
features (the bundled model's 4,096-token vocabulary and tokenizer), so what a step costs beyond the
forward is the engine itself: scheduling, building the batch, sampling, bookkeeping, detokenizing,
the outputs. `--requests` requests with 16-token prompts and 96 new tokens each (greedy, ignore_eos)
are all admitted and prefilled; then every `LLMEngine.step()` of the decode phase is timed while all of
them run, and so is the model's forward inside it (`forward_paged` + `compute_logits`, found by class
so the same script times any stage's code). engine = step - forward. Each run reports the median step
(and the mean, which also counts the occasional slow step, a garbage collection for instance).

Writes results/engine_step.json (every run, and the medians).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import drain

ROOT = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, n_layer: int, n_head: int, n_embd: int, seed: int = 0) -> Path:
    """A random-weight GPT-2 with the bundled model's vocabulary and tokenizer files."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from roseinfer import DEFAULT_MODEL

    bundled = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=bundled["vocab_size"],
                     n_positions=bundled["n_positions"], bos_token_id=bundled["eos_token_id"],
                     eos_token_id=bundled["eos_token_id"])  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(path)
    for name in ("tokenizer.tiktoken", "vocab.json", "merges.txt"):
        if (Path(DEFAULT_MODEL) / name).exists():
            shutil.copy(Path(DEFAULT_MODEL) / name, path / name)
    return path


class ForwardTimer:
    """Adds up the wall time of the model's forward calls (the GPT-2 module's `forward_paged` and
    `compute_logits`), wherever this stage's code keeps the class."""

    def __init__(self, model_cls):
        self.seconds, self.cls = 0.0, model_cls
        self.saved = {name: getattr(model_cls, name) for name in ("forward_paged", "compute_logits")}
        for name, fn in self.saved.items():
            setattr(model_cls, name, self._timed(fn))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapper

    def close(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


def gpt2_class():
    """The GPT2 class of the roseinfer that was imported (another stage's code keeps it in roseinfer/model.py)."""
    import importlib

    import roseinfer

    pkg = Path(roseinfer.__file__).parent
    name = "roseinfer.model_executor.gpt2" if (pkg / "model_executor" / "gpt2.py").exists() else "roseinfer.model"
    return importlib.import_module(name).GPT2


def one_run(model_dir: Path, args, profile: bool) -> dict:
    from roseinfer import LLMEngine, SamplingParams

    extra = {k: True for k in ("enforce_eager", "async_scheduling") if getattr(args, k)}  # stage 16's options
    eng = LLMEngine(str(model_dir), device=args.device, max_num_seqs=args.requests, num_blocks=args.requests * 8,
                    max_num_batched_tokens=max(2048, args.requests * args.prompt_len), **extra)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.requests):
        prompt = torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist()
        eng.add_request(f"r{i}", prompt, params)
    eng.step()  # every prompt in one step (the budget covers them): from now on, decode steps only
    if args.gc_unfreeze:  # undo the engine's gc.freeze(), to see what it saves
        import gc

        gc.unfreeze()
    timer = ForwardTimer(gpt2_class())
    prof = cProfile.Profile() if profile else None
    steps, fwd = [], []
    try:
        for _ in range(args.new_tokens - 2):  # all requests still run in every one of these steps
            before = timer.seconds
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
            if prof is not None:
                prof.disable()
            fwd.append(timer.seconds - before)
    finally:
        timer.close()
    drain(eng)
    num_profiled = len(steps)  # the profiler saw every decode step, warm-up included
    skip = args.warmup_steps  # the first decode steps grow buffers and warm caches
    steps, fwd = steps[skip:], fwd[skip:]
    engine = [s - f for s, f in zip(steps, fwd, strict=True)]
    out = {"step_ms": statistics.median(steps) * 1e3, "forward_ms": statistics.median(fwd) * 1e3,
           "engine_ms": statistics.median(engine) * 1e3, "mean_step_ms": statistics.fmean(steps) * 1e3,
           "mean_engine_ms": statistics.fmean(engine) * 1e3, "steps_timed": len(steps)}  # fmt: skip
    if prof is not None:
        out["profile"] = profile_table(prof, num_profiled, args.top)
    return out


def profile_table(prof: cProfile.Profile, num_steps: int, top: int) -> list[dict]:
    """The functions with the most time spent inside them (cProfile's tottime), per step."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    table = []
    for (file, line, name), (_, calls, tottime, _, _) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        table.append({"function": where, "calls_per_step": calls / num_steps, "ms_per_step": tottime / num_steps * 1e3})
    return table


KEYS = ("step_ms", "forward_ms", "engine_ms", "mean_step_ms", "mean_engine_ms")


def print_runs(code, args, runs: list[dict], med: dict) -> None:
    print(f"# roseinfer from {code}, {args.threads} thread(s), {args.requests} running requests")
    print("per decode step: the median over a run's steps (and the mean, which includes the rare slow step)")
    print("| run | step ms | forward ms | engine ms | mean step ms | mean engine ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in [*((str(i), r) for i, r in enumerate(runs, 1)), ("median of runs", med)]:
        print(f"| {name} | " + " | ".join(f"{r[k]:.2f}" for k in KEYS) + " |")
    print(f"engine per running request: {med['engine_ms'] * 1e3 / args.requests:.1f} us per step")


def compare(args) -> None:
    """This checkout against another (`--against DIR`), one run each in turn, each in a fresh process."""
    here, there = ROOT, Path(args.against).resolve()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("requests", "prompt_len", "new_tokens", "threads", "warmup_steps")]  # fmt: skip
    results: dict[Path, list[dict]] = {here: [], there: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for root in (there, here):
                out = Path(tmp) / "run.json"
                env = {**os.environ, "PYTHONPATH": str(root)}
                subprocess.run([sys.executable, __file__, *flags, "--runs=1", f"--out={out}"], env=env, check=True,
                               capture_output=True)  # fmt: skip
                results[root].append(json.loads(out.read_text())["runs"][0])
    medians = {root: {k: statistics.median(r[k] for r in runs) for k in KEYS} for root, runs in results.items()}
    print(f"# {args.runs} runs each, in turn; {args.threads} thread(s), {args.requests} running requests")
    print("| code | step ms | forward ms | engine ms | mean step ms | mean engine ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for root, med in medians.items():
        print(f"| {root.name} (median) | " + " | ".join(f"{med[k]:.2f}" for k in KEYS) + " |")
    a, b = medians[here], medians[there]
    step, engine = a["step_ms"] / b["step_ms"], a["engine_ms"] / b["engine_ms"]
    print(f"{here.name} / {there.name}: step time {step:.2f}x, engine time {engine:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": {str(k): v for k, v in results.items()},
                               "median": {str(k): v for k, v in medians.items()}}, indent=1))  # fmt: skip
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA, forward ms is the host's time to launch it)")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    ap.add_argument("--async-scheduling", action="store_true", help="schedule the next step while this one runs")
    ap.add_argument("--gc-unfreeze", action="store_true", help="undo the engine's gc.freeze() (to measure it)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="one more run under cProfile, printed as a table")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument(
        "--against", default=None, help="another checkout (a stage's worktree) to run in turn with this one"
    )
    ap.add_argument("--out", default=str(ROOT / "results" / "engine_step.json"))
    args = ap.parse_args()
    if args.against:
        return compare(args)
    torch.set_num_threads(args.threads)
    import roseinfer

    code = Path(roseinfer.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(Path(tmp) / "gpt2-1x64", n_layer=1, n_head=2, n_embd=64)
        runs = [one_run(model_dir, args, profile=False) for _ in range(args.runs)]
        prof = one_run(model_dir, args, profile=True) if args.profile else None
    med = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    print_runs(code, args, runs, med)
    if prof is not None:
        print(f"\ncProfile of one more run (step {prof['step_ms']:.2f} ms under the profiler), per decode step:")
        print("| function | calls/step | ms/step |")
        print("|---|---:|---:|")
        for row in prof["profile"]:
            print(f"| {row['function']} | {row['calls_per_step']:.0f} | {row['ms_per_step']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"code": str(code), "args": vars(args), "runs": runs, "median": med,
                               "profile": prof and prof["profile"]}, indent=1))  # fmt: skip
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
