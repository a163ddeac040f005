"""What the scheduler tells the model runner, step by step: only what changed (chapter 16).

./engine_core_example.sh
./engine_core_example.sh --steps 12 --block-size 4

Three requests run on the bundled model; one of them asks for two completions. For every step the
script prints the SchedulerOutput the runner received: requests it sees for the first time (their prompt
and whole block table), the ones it knows (how far each is computed, and the tail of its block table
when it changed), forks, finished ids, and the size of the message once pickled. Then it times the
layers of one step at 256 running requests.
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from roseinfer import LLMEngine, SamplingParams

PROMPTS = {
    "a": ("Romeo.\n", SamplingParams(temperature=0, max_tokens=9)),
    "b": ("Enter Hamlet, reading.\n", SamplingParams(temperature=0, max_tokens=5)),
    "c": ("KING.", SamplingParams(temperature=0.8, seed=1, max_tokens=6, n=2)),
}


def describe(so) -> list[str]:
    lines = []
    for r in so.scheduled_new_reqs:
        lines.append(f"new     {r.req_id:4} {len(r.prompt_token_ids):2} prompt tokens from {r.num_computed_tokens}, "
                     f"blocks {r.block_ids}")  # fmt: skip
    c = so.scheduled_cached_reqs
    for rid, computed, blocks, resumed in zip(c.req_ids, c.num_computed_tokens, c.new_block_ids,
                                              c.resumed_from_preemption, strict=True):  # fmt: skip
        change = "" if blocks is None else f", table from index {blocks[0]}: {blocks[1]}"
        lines.append(
            f"cached  {rid:4} +{so.num_scheduled_tokens[rid]} at {computed}{change}{' (resumed)' if resumed else ''}"
        )
    for f in so.forks:
        lines.append(f"fork    {f.child_id:4} from {f.parent_id}, blocks {f.block_ids}")
    if so.finished_req_ids:
        lines.append(f"finished {sorted(so.finished_req_ids)} (the runner drops their rows)")
    return lines


def show_steps(args) -> None:
    eng = LLMEngine(device="cpu", block_size=args.block_size, num_blocks=64, enable_prefix_caching=False)
    for rid, (prompt, params) in PROMPTS.items():
        eng.add_request(rid, prompt, params)
    n = 0
    while eng.has_unfinished_requests() and n < args.steps:
        outs = eng.step()
        n += 1
        so = eng.last_scheduler_output  # the step's message, as the core sent it to the runner
        print(f"step {n}: {so.total_num_scheduled_tokens} token(s), message {len(pickle.dumps(so))} bytes pickled")
        for line in describe(so):
            print("   ", line)
        done = [f"{o.request_id} ({o.finish_reason})" for o in outs if o.finished]
        if done:
            print("    -> finished:", ", ".join(done))
    while eng.has_unfinished_requests():
        eng.step()


def time_layers(args) -> None:
    """One decode step at `--requests` running requests, split by layer (1 thread)."""
    torch.set_num_threads(1)
    eng = LLMEngine(device="cpu", max_num_seqs=args.requests, num_blocks=args.requests * 8,
                    max_num_batched_tokens=max(2048, args.requests * 16))  # fmt: skip
    for i in range(args.requests):
        eng.add_request(str(i), list(range(1 + i % 50, 17 + i % 50)), SamplingParams(temperature=0, max_tokens=40))
    eng.step()  # the prefills
    core = eng.engine_core.engine_core  # the in-process EngineCore, to time the parts of its step one by one
    runner = core.model_runner
    spent = dict.fromkeys(("schedule", "runner", "update", "output processor"), 0.0)
    steps = 20
    for _ in range(steps):
        t0 = time.perf_counter()
        so = core.scheduler.schedule()
        t1 = time.perf_counter()
        out = runner.execute_model(so)
        t2 = time.perf_counter()
        core_outputs = core.scheduler.update_from_output(so, out)
        t3 = time.perf_counter()
        eng.output_processor.process_outputs(core_outputs)
        t4 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[key] += dt
    print(f"\none decode step at {args.requests} running requests (bundled model, 1 thread, mean of {steps}):")
    for key, s in spent.items():
        print(f"    {key:17} {s / steps * 1e3:6.2f} ms")
    for rid in list(eng.output_processor.requests):
        eng.abort_request(rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="steps to print")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--requests", type=int, default=256, help="running requests for the timing (0: skip it)")
    args = ap.parse_args()
    show_steps(args)
    if args.requests:
        time_layers(args)


if __name__ == "__main__":
    main()
