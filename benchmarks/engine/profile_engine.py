"""Where does an engine step spend its time? cProfile of `LLM.generate` on a benchmark workload (chapter 09).

    python benchmarks/engine/profile_engine.py                         # this checkout, small workload, 2 threads
    python benchmarks/engine/profile_engine.py --threads 1 --top 15
    PYTHONPATH=../roseinfer-08 python benchmarks/engine/profile_engine.py   # another stage's code (a worktree)

It uses only the `LLM` API that every stage since 03 has, so the same command profiles any of them.
The table lists the functions with the most time spent *inside* them (cProfile's tottime), as a share
of the whole run: PyTorch ops show up as their builtins (`linear`, `scaled_dot_product_attention`,
`index_select`, ...), Python bookkeeping as our own functions.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from benchmarks import benchmark  # the same seeded workloads; roseinfer is the one PYTHONPATH names first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["small", "mixed", "shared-prefix"], default="small")
    ap.add_argument("--batch-size", type=int, default=32, help="max_num_seqs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from roseinfer import DEFAULT_MODEL, LLM, SamplingParams

    cfg = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())  # the bundled model
    bench_args = benchmark.parse_args(["--workload", args.workload])
    wl = benchmark.make_workload(bench_args, cfg["n_positions"], cfg["vocab_size"], Path(DEFAULT_MODEL))
    prompts, lens, n = wl.prompts, wl.output_lens, len(wl.prompts)
    ps = inspect.signature(LLM).parameters  # 03-05: no max_num_seqs; 06-15: a parameter; 16+: an EngineArgs kwarg
    takes = "max_num_seqs" in ps or any(p.kind is p.VAR_KEYWORD for p in ps.values())
    kw = {"max_num_seqs": args.batch_size} if takes else {}
    llm = LLM(device="cpu", **kw)
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(llm.generate, prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # every function's tottime: the whole profiled run
    print(f"# roseinfer from {Path(sys.modules['roseinfer'].__file__).parent}, {torch.get_num_threads()} threads")
    print(f"# {n} requests, {sum(lens)} output tokens in {secs:.1f} s under the profiler "
          f"({sum(lens) / secs:.0f} tok/s; profiling slows Python code down)")  # fmt: skip
    print(f"| {'function':58s} | {'calls':>7} | {'own time s':>10} | {'share':>6} |")
    print(f"|{'-' * 60}|{'-' * 8}:|{'-' * 11}:|{'-' * 7}:|")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]
    for (file, line, name), (_, calls, tottime, _, _) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        print(f"| {where[:58]:58s} | {calls:>7} | {tottime:>10.2f} | {tottime / total:>6.1%} |")


if __name__ == "__main__":
    main()
