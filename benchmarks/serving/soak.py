"""Soak test (not run in CI): thousands of requests through LLMEngine on the bundled model.

    python benchmarks/serving/soak.py                       # 2,000 requests
    python benchmarks/serving/soak.py --num-requests 200    # a quick look

Requests arrive in waves while others run; half are greedy, half sampled; some have stop
strings, some are aborted mid-flight. At the end it reports throughput, peak memory and
checks that nothing leaked: no KV block held, no request or sequence left, no block table kept.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from roseinfer import LLMEngine, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--wave", type=int, default=50, help="requests added per wave")
    ap.add_argument("--num-blocks", type=int, default=192, help="a pool small enough to force preemptions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    eng = LLMEngine(device="cpu", max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks)
    vocab = eng.config.model_config.vocab_size - 1
    finished, aborted, out_tokens, next_id, steps = 0, 0, 0, 0, 0
    reasons: dict[str, int] = {}
    t0 = time.perf_counter()
    while next_id < args.num_requests or eng.has_unfinished_requests():
        if next_id < args.num_requests and len(eng.output_processor.requests) < args.max_num_seqs:  # a new wave
            for _ in range(min(args.wave, args.num_requests - next_id)):
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 64))]
                greedy = rng.random() < 0.5
                params = SamplingParams(
                    temperature=0 if greedy else rng.choice([0.7, 1.0, 1.3]),
                    top_k=rng.choice([-1, 20, 50]), top_p=rng.choice([1.0, 0.9]),
                    max_tokens=rng.randint(4, 64), seed=next_id,
                    stop=["\n\n"] if rng.random() < 0.2 else [],
                )  # fmt: skip
                eng.add_request(str(next_id), prompt, params)
                next_id += 1
        for rid in [r for r in eng.unfinished_request_ids if rng.random() < 0.0005]:  # now and then, a client goes away
            eng.abort_request(rid)
            aborted += 1
        for out in eng.step():
            out_tokens += 1
            if out.finished:
                finished += 1
                reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
        steps += 1
    dt = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state, stats = eng.get_scheduler_state(), eng.get_stats()
    leaks = {"blocks in use": stats["kv_blocks_used"], "unfinished requests": len(eng.output_processor.requests),
             "scheduled sequences": len(state["running"] + state["waiting"] + state["swapped"]),
             "block tables": len(state["block_tables"])}  # fmt: skip
    print(f"{args.num_requests} requests ({finished} finished {reasons}, {aborted} aborted) in {steps} steps")
    print(f"{out_tokens} output tokens in {dt:.1f}s: {out_tokens / dt:.0f} output tok/s, "
          f"{stats['num_preemptions']} preemptions")  # fmt: skip
    print(f"peak RSS {peak_mib:.0f} MiB (KV pool {stats['kv_cache_bytes'] / 2**20:.0f} MiB)")
    print("leaks: " + ", ".join(f"{k} {v}" for k, v in leaks.items()))
    ok = finished + aborted == args.num_requests and not any(leaks.values())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
