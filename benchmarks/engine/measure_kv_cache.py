"""Naive decode vs KV-cache decode: output tokens/s at 64, 256 and 512 new tokens.

    python benchmarks/engine/measure_kv_cache.py

Both decode greedily from the same 1-token prompt with ignore_eos, so they do exactly the same number
of steps. The context is 512 tokens, so "512" means 511 new tokens after the 1-token prompt.

naive     chapter 01's loop, written out here: every new token re-runs the model's dense forward
          `GPT2.forward(input_ids [1, T])` (roseinfer/model_executor/gpt2.py) over the whole sequence
KV cache  the engine: `LLM.generate` on that one request (prefill once, then one token per step)

The two must produce the same tokens; the table says so in its last column.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from roseinfer import DEFAULT_MODEL, LLM, SamplingParams
from roseinfer.config import pick_device, pick_dtype
from roseinfer.model_executor.loader import load_model, read_model_config, resolve_model_dir


@torch.inference_mode()
def naive_decode(model, prompt: list[int], n: int) -> list[int]:
    """Greedy, no cache: the whole sequence through the model for every new token."""
    ids = torch.tensor([prompt], device=model.transformer.wte.weight.device)
    for _ in range(min(n, model.config.n_positions - len(prompt))):
        next_id = model(ids)[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt) :].tolist()


def tokens_per_s(run, repeats: int) -> tuple[list[int], float]:
    """The tokens of one run and the output tokens/s of the best of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = run()
        best = min(best, time.perf_counter() - t0)
    return tokens, len(tokens) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256, 512])
    args = ap.parse_args()
    device = pick_device(args.device)
    dtype = pick_dtype(None, device)  # the engine's default: fp32 on CPU, fp16 on CUDA
    path = resolve_model_dir(args.model)
    cfg = read_model_config(path)
    model = load_model(path, cfg, device, dtype)
    llm = LLM(args.model, device=device, dtype=dtype, enable_prefix_caching=False)
    prompt = [cfg.eos_token_id if cfg.eos_token_id is not None else 0]
    name = os.path.relpath(args.model) if os.path.isdir(args.model) else args.model
    print(f"model {name}, device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'new tokens':>10} {'naive tok/s':>12} {'KV cache tok/s':>15} {'speedup':>8}  same tokens")
    for n in args.new_tokens:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        slow, a = tokens_per_s(lambda n=n: naive_decode(model, prompt, n), args.repeats)
        fast, b = tokens_per_s(lambda p=params: llm.generate([prompt], p, use_tqdm=False)[0].token_ids, args.repeats)
        print(f"{len(slow):>10} {a:>12.1f} {b:>15.1f} {b / a:>7.2f}x  {slow == fast}")


if __name__ == "__main__":
    main()
