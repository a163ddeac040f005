"""Throughput of the offline scheduler for 1, 4 and 16 concurrent requests (chapter 03).

    python benchmarks/engine/measure_offline.py

Every request has the same 32-token prompt and decodes 64 tokens greedily (ignore_eos),
so the only thing that changes between rows is how many requests share the scheduler.
"""

from __future__ import annotations

import argparse
import time

import torch

from roseinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.config.model_config.vocab_size - 1
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"prompt {args.prompt_len} tokens, {args.max_tokens} new tokens each")  # fmt: skip
    print(f"{'requests':>8} {'output tokens':>14} {'seconds':>8} {'output tok/s':>13}")
    for n in args.counts:
        prompts = torch.randint(0, vocab, (n, args.prompt_len), generator=g).tolist()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"{n:>8} {tokens:>14} {dt:>8.2f} {tokens / dt:>13.1f}")


if __name__ == "__main__":
    main()
