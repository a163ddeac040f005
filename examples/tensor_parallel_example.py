"""Tensor parallelism end to end (chapter 15): one model split across 2 processes on this CPU (gloo).

    ./tensor_parallel_example.sh
    ./tensor_parallel_example.sh --model path/to/gpt2-dir --max-tokens 32

1. the shapes rank 0 holds, against the whole model's; 2. the same prompts, greedy, with
tensor_parallel_size 1 and 2: the same tokens; 3. each rank's KV pool; 4. the all-reduces of one step;
5. closing the LLM stops the worker; 6. a worker killed mid-run is a clear error on rank 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch

from roseinfer import LLM, SamplingParams  # noqa: E402
from roseinfer.model_executor.parallel_layers import CommStats  # noqa: E402

PROMPTS = ["Romeo.\n", "KING.", "To be, or not to be", "O, what a rogue and peasant slave am I!"]


def running(pids: list[int]) -> list[int]:
    """The pids that still exist (rank 0 reaps its workers when it stops them)."""
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(2)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", num_blocks=64)

    one = LLM(args.model, **kw)
    ids1 = [o.token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    kv1 = one.llm_engine.get_stats()["kv_cache_bytes"]

    t0 = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=2, **kw)
    # a look inside the in-process core: its runner is a TensorParallelRunner (rank 0, and the workers' pids)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    print(f"LLM(tensor_parallel_size=2): rank 0 is this process (pid {os.getpid()}), rank 1 is pid {runner.pids[0]}; "
          f"started in {time.perf_counter() - t0:.1f} s")  # fmt: skip

    print("\n1. block 0 on rank 0 (nn.Linear weights are [out, in]):")
    full = one.llm_engine.engine_core.apply_model(lambda model: model.transformer.h[0].state_dict())
    for name, w in runner.model.transformer.h[0].state_dict().items():
        if name.endswith("weight") and "ln" not in name:
            print(f"   {name:<20} {str(tuple(w.shape)):<12} of {tuple(full[name].shape)}")

    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    print(f"\n2. greedy, {args.max_tokens} tokens, TP = 2 against TP = 1:")
    for p, o, ref in zip(PROMPTS, outs, ids1, strict=True):
        print(f"   {p!r:<44} {'same tokens' if o.token_ids == ref else 'DIFFERENT'}  {o.text[:40]!r}")

    print(f"\n3. KV pool of 64 blocks: TP = 1 {kv1:,} bytes; TP = 2 rank 0 {runner.kv_cache.nbytes:,}, "
          f"rank 1 {runner.worker_kv_bytes[0]:,} bytes")  # fmt: skip
    k = runner.kv_cache.layers[0][0]
    print(f"   layer 0's K on rank 0: {tuple(k.shape)} = [blocks, block_size, heads, head_dim]")

    CommStats.enabled = True
    llm.generate(["Romeo.\n"] * 4, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    CommStats.enabled = False
    cfg = llm.llm_engine.config.model_config.hf_config
    print(
        f"\n4. one step of 4 prompts of 3 tokens (12 rows): {CommStats.calls} all-reduces (2 · n_layer = "
        f"{2 * cfg.n_layer}), {CommStats.bytes:,} bytes in all = 2 · {cfg.n_layer} · 12 · {cfg.n_embd} · 4"
    )

    llm.close()
    time.sleep(0.2)
    print(f"\n5. llm.close(): worker {runner.pids[0]} running: {bool(running(runner.pids))}")

    llm = LLM(args.model, tensor_parallel_size=2, **kw)
    pid = llm.llm_engine.engine_core.engine_core.model_runner.pids[0]
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    print(f"\n6. kill -9 {pid} (rank 1) while 4 requests of 400 tokens run:")
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    except RuntimeError as e:
        print(f"   RuntimeError: {e}")
    print(f"   worker running: {bool(running([pid]))}; requests left: {len(llm.llm_engine.output_processor.requests)}")


if __name__ == "__main__":  # needed: each rank is started with spawn, which imports this file again
    main()
