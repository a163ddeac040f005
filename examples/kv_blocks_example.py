"""Print the KV block tables as requests are prefilled, grow and finish (chapter 04).

./kv_blocks_example.sh
./kv_blocks_example.sh --block-size 8 --num-blocks 24 --steps 1 2 9 17 30
"""

from __future__ import annotations

import argparse

from roseinfer import LLM, SamplingParams

PROMPTS = [
    "Romeo.\n",
    "Enter Hamlet, reading.\n\nPolonius.\nWhat do you read, my lord?\n\nHamlet.\nWords, words, words.\n",
    "KING LEAR.\nBlow, winds, and crack your cheeks! rage! blow!\n",
    "Portia.\n",
]


def render(snapshot: dict, block_size: int) -> str:
    """One line per request: [physical id: filled/size] per logical block."""
    lines = []
    for rid, table in snapshot["block_tables"].items():
        n = snapshot["num_tokens"][rid]
        cells = [f"{b:>3}:{min(block_size, n - i * block_size):>2}/{block_size}" for i, b in enumerate(table)]
        lines.append(f"  req {rid} ({n:>3} tok) | " + " ".join(f"[{c}]" for c in cells))
    s = snapshot["stats"]
    if s.allocated_slots == 0:  # an empty pool: no slot is filled, and none is wasted either
        lines.append(f"  used 0/{s.num_blocks} blocks: nothing allocated")
    else:
        lines.append(
            f"  used {s.used_blocks}/{s.num_blocks} blocks, {s.used_slots}/{s.allocated_slots} slots filled "
            f"(utilisation {s.utilization:.0%}, fragmentation {s.fragmentation:.0%})"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[12, 30, 20, 6], help="per prompt")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 6, 7, 13, 21, 30], help="steps to print")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    llm = LLM(model=args.model, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
              enable_prefix_caching=False)  # fmt: skip
    eng = llm.llm_engine
    eng.trace = []  # every step: who ran, and a copy of the KV cache manager's books (block tables, counts)
    for i, prompt in enumerate(PROMPTS):
        m = args.max_tokens[i % len(args.max_tokens)]
        eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        print(f"request {i}: {len(llm.tokenizer.encode(prompt))} prompt tokens, {m} new tokens")
    while eng.has_unfinished_requests():
        eng.step()
    print(f"\nblock_size {args.block_size}, pool of {args.num_blocks} blocks; tables after selected steps:")
    for t in eng.trace:
        finished = t["finished"]
        if t["step"] in args.steps or finished or t["preempted_req_ids"]:
            who = f"request {finished[0]}; its" if len(finished) == 1 else f"requests {' '.join(finished)}; their"
            note = f"  (finished: {who} blocks are free again)" if finished else ""
            if t["preempted_req_ids"]:  # a pool too small for everyone: the youngest gives its blocks back
                note += f"  (preempted: {' '.join(t['preempted_req_ids'])}, to be recomputed)"
            print(f"\nstep {t['step']}: ran {' '.join(t['ran'])}{note}")
            print(render(t, args.block_size))
    s = eng.get_scheduler_state()["stats"]
    print(f"\nafter the run: {s.used_blocks} blocks in use, {s.free_blocks} free")


if __name__ == "__main__":
    main()
