"""Requests arriving over time, served by continuous batching (chapter 06).

A seeded schedule says at which engine step each request arrives; some are long, some
short. Every step we print who is waiting, running and finished (steps where nothing
changes are skipped), and at the end each request's time to first token (TTFT) and
total latency.

    ./online_example.sh
    ./online_example.sh --num-requests 10 --max-num-seqs 3 --seed 2
"""

from __future__ import annotations

import argparse
import random
import time

from roseinfer import LLMEngine, SamplingParams

PROMPTS = ["Romeo.\n", "Juliet.\n", "Hamlet.\n", "Enter the Ghost.\n", "Lear.\n", "Portia.\n", "Nurse.\n", "Fool.\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    schedule, step_at = [], 0
    for i in range(args.num_requests):  # (arrival step, id, prompt, max_tokens): a mix of long and short
        long = rng.random() < 0.4
        n = rng.randint(60, 100) if long else rng.randint(8, 24)
        schedule.append((step_at, str(i), PROMPTS[i % len(PROMPTS)], n))
        step_at += rng.randint(0, 12)
    engine = LLMEngine(args.model, device=args.device, max_num_seqs=args.max_num_seqs)
    print(f"max_num_seqs={args.max_num_seqs}; arrivals (step: request/new tokens): "
          + ", ".join(f"{a}: {rid}/{n}" for a, rid, _, n in schedule))  # fmt: skip

    arrived, first, done = {}, {}, {}
    pending = list(schedule)
    for step in range(args.max_steps):
        if not pending and not engine.has_unfinished_requests():
            break
        events = []
        while pending and pending[0][0] <= step:
            _, rid, prompt, n = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(temperature=0.8, top_k=40, max_tokens=n, seed=int(rid)))
            arrived[rid] = time.perf_counter()
            events.append(f"request {rid} arrives")
        running_before = engine.get_scheduler_state()["running"]
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first:
                first[out.request_id] = now
                if running_before:
                    events.append(f"request {out.request_id} joins while {' '.join(running_before)} are mid-decode")
            if out.finished:
                done[out.request_id] = (now, len(out.token_ids), out.finish_reason)
        finished = [o.request_id for o in outputs if o.finished]
        if events or finished or step % 20 == 0:
            state = engine.get_scheduler_state()
            waiting, running = " ".join(state["waiting"]) or "-", " ".join(state["running"]) or "-"
            ended = " ".join(finished) or "-"
            line = f"step {step:3d} | waiting: {waiting:<10} | running: {running:<12} | finished: {ended}"
            print(line + ("   <- " + "; ".join(events) if events else ""))

    print(f"\n{'request':>7} {'arrives@step':>12} {'new tokens':>10} {'TTFT ms':>8} {'latency ms':>10}  finish")
    for a, rid, _, _ in schedule:
        end, n, why = done[rid]
        ttft, total = 1000 * (first[rid] - arrived[rid]), 1000 * (end - arrived[rid])
        print(f"{rid:>7} {a:>12} {n:>10} {ttft:>8.1f} {total:>10.1f}  {why}")
    print(f"KV blocks in use after the run: {engine.get_stats()['kv_blocks_used']}")


if __name__ == "__main__":
    main()
