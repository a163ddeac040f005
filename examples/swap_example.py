"""Preemption by swapping and by recompute, side by side, under a KV pool that is far too small (chapter 12).

    ./swap_example.sh
    ./swap_example.sh --requests 12 --num-blocks 16 --figure queues.png

The same requests (greedy, the same prompts) run twice on a pool of `--num-blocks` blocks of 4 tokens:
once with preemption_mode="swap", once with "recompute". Part 1 prints the steps of the swap run in which
something was preempted or came back: the three queues and the blocks moved. Part 2 compares the two
runs: steps, preemptions, tokens computed (recompute computes some twice) and blocks moved (swap copies
them out and back), and checks that both produced the same tokens. `--figure` plots the queues and the
pool usage of the swap run over time.
"""

from __future__ import annotations

import argparse

from benchmarks.common import finished_tokens
from roseinfer import LLMEngine, SamplingParams

PROMPTS = ["Romeo.\n", "Enter the Ghost.\n", "KING.", "Nurse.\n", "To be, or not to be", "O Romeo, Romeo!",
           "HAMLET.\n", "Exeunt.\n"]  # fmt: skip


def run(mode: str, args) -> tuple[LLMEngine, dict[str, list[int]]]:
    eng = LLMEngine(args.model, device=args.device, block_size=4, num_blocks=args.num_blocks,
                    max_num_seqs=args.requests, preemption_mode=mode, swap_space=args.swap_space)  # fmt: skip
    eng.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        eng.add_request(str(i), PROMPTS[i % len(PROMPTS)], params)
    return eng, finished_tokens(eng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--num-blocks", type=int, default=12)
    ap.add_argument("--swap-space", type=float, default=0.01, help="GiB of host memory for swapped blocks")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--figure", default=None, help="write the queues / pool usage plot of the swap run here")
    args = ap.parse_args()

    swap, swap_tokens = run("swap", args)
    print(f"{args.requests} requests, {args.max_tokens} new tokens each, a pool of {args.num_blocks} blocks of 4")
    print("\nswap run: the steps that preempted or resumed (running / waiting / swapped, blocks moved)")
    for t in swap.trace:
        if t["preempted_req_ids"] or t["blocks_to_swap_in"]:
            moved = f"out {t['blocks_to_swap_out']}" if t["blocks_to_swap_out"] else f"in {t['blocks_to_swap_in']}"
            print(f"  step {t['step']:3d}  running {','.join(t['running']) or '-':12s} waiting "
                  f"{','.join(t['waiting']) or '-':8s} swapped {','.join(t['swapped']) or '-':8s} {moved}")  # fmt: skip

    recompute, recompute_tokens = run("recompute", args)
    print("\n             steps  preemptions  swapped out  tokens computed  blocks moved")
    for name, eng in (("swap", swap), ("recompute", recompute)):
        s = eng.get_stats()
        computed = sum(sum(t["num_scheduled_tokens"].values()) for t in eng.trace)
        moved = sum(len(t["blocks_to_swap_out"]) + len(t["blocks_to_swap_in"]) for t in eng.trace)
        print(f"  {name:10s} {eng.num_steps:6d} {s['num_preemptions']:12d} {s['num_swapped_out']:12d} "
              f"{computed:16d} {moved:13d}")  # fmt: skip
    same = swap_tokens == recompute_tokens
    print(f"\nsame tokens from both runs: {same}")
    if not same:
        raise SystemExit("the two preemption modes disagree")

    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [t["step"] for t in swap.trace]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
        for key in ("running", "waiting", "swapped"):
            ax1.step(steps, [len(t[key]) for t in swap.trace], where="post", label=key)
        ax1.set_ylabel("requests")
        ax1.legend(loc="upper right")
        ax2.step(steps, [t["stats"].used_blocks for t in swap.trace], where="post", label="device blocks in use")
        ax2.step(steps, [t["swap_blocks_used"] for t in swap.trace], where="post", label="host blocks in use")
        ax2.axhline(args.num_blocks, color="gray", lw=0.8, ls="--")
        ax2.set_xlabel("step")
        ax2.set_ylabel("KV blocks")
        ax2.legend(loc="upper right")
        fig.suptitle(f"preemption by swap: {args.requests} requests, {args.num_blocks} device blocks")
        fig.tight_layout()
        fig.savefig(args.figure, dpi=110)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
