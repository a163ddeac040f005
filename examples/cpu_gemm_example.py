"""The same requests through both linear backends on a GPT-2-small-shaped model (chapter 17).

    python examples/cpu_gemm_example.py                 # 16 requests, 1 thread
    python examples/cpu_gemm_example.py --threads 2 --requests 32

`linear_backend="aten"` runs every linear layer through F.linear (MKL's sgemm on this CPU);
`linear_backend="onednn"` (the default on a CPU) through oneDNN with each weight reordered once at load.
It prints each backend's throughput, the packed layers, and whether the greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks import benchmark  # benchmarks/benchmark.py: random weights with GPT-2 small's shapes, cached
from roseinfer import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = benchmark.resolve_model("gpt2", benchmark.REPO / ".cache" / "random-models")
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(rng.randint(16, 128))] for _ in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(32, 96), ignore_eos=True) for _ in prompts]
    new_tokens = sum(p.max_tokens for p in params)
    print(f"GPT-2 small shapes (random weights), {args.requests} requests, {new_tokens} new tokens, "
          f"{args.threads} thread(s)")  # fmt: skip
    tokens = {}
    for backend in ("aten", "onednn"):
        llm = LLM(model=str(model), max_num_seqs=32, linear_backend=backend)
        net = llm.llm_engine.engine_core.apply_model(lambda model: model)  # rank 0's model, this process
        packed = sum(getattr(m, "packed", None) is not None for m in net.modules())
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        tokens[backend] = [o.token_ids for o in outs]
        print(f"  linear_backend={backend:<7} {packed:2d} linear layers packed, LM head packed: "
              f"{net.head_packed is not None!s:<5}  {new_tokens / secs:6.1f} tok/s")  # fmt: skip
        del llm, net
    print(f"  greedy tokens identical: {tokens['aten'] == tokens['onednn']}")


if __name__ == "__main__":
    main()
