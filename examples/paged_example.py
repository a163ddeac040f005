"""A KV pool too small for everyone at once: watch blocks fill up and requests get preempted (chapter 07).

    ./paged_example.sh
    ./paged_example.sh --num-blocks 24 --block-size 8

Six requests share a pool of a few blocks. When a running request needs a new block and
none is free, the most recently admitted one is preempted: its blocks go back, it waits at
the front of the queue, and later recomputes its K/V and carries on. Every request still
ends with exactly the text it would have produced alone.
"""

from __future__ import annotations

import argparse

from kv_blocks_example import render  # examples/kv_blocks_example.py, beside this file

from roseinfer import LLM, LLMEngine, SamplingParams

PROMPTS = ["Romeo.\n", "Juliet.\n", "Enter the Ghost.\n\nHamlet.\n", "Lear.\n", "Nurse.\n", "Fool.\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    eng = LLMEngine(args.model, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks)
    eng.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(str(i), prompt, params)
    print(f"{len(PROMPTS)} requests, {args.max_tokens} new tokens each; pool: {args.num_blocks} blocks of "
          f"{args.block_size} tokens ({eng.get_stats()['kv_cache_bytes'] / 1024:.0f} KiB of K/V)")  # fmt: skip
    texts = {}
    last_preemptions, step = 0, 0
    while eng.has_unfinished_requests():
        running_before = eng.get_scheduler_state()["running"]
        for out in eng.step():
            if out.finished:
                texts[out.request_id] = out.text
        t = eng.trace[-1]
        step += 1
        preempted = [r for r in running_before if r in t["waiting"]]
        if t["preemptions"] > last_preemptions or t["finished"] or step in (1, 2):
            events = []
            if preempted:
                events.append(f"PREEMPTED {' '.join(preempted)} (blocks freed, back to the front of waiting)")
            if t["finished"]:
                events.append(f"finished {' '.join(t['finished'])}")
            waiting = " ".join(t["waiting"]) or "-"
            print(f"\nstep {step}: ran {' '.join(t['ran'])}; waiting: {waiting}  {'; '.join(events)}")
            print(render(t, args.block_size))
            last_preemptions = t["preemptions"]
    print(f"\n{eng.get_stats()['num_preemptions']} preemptions in {step} steps; "
          f"blocks in use after the run: {eng.get_stats()['kv_blocks_used']}")  # fmt: skip
    ref = LLM(args.model, device=args.device)  # a pool with room for everyone: nobody is preempted
    solo = {str(i): ref.generate([p], params, use_tqdm=False)[0].text for i, p in enumerate(PROMPTS)}
    same = sum(texts[r] == solo[r] for r in solo)
    print(f"{same}/{len(solo)} requests produced exactly their solo (unpreempted) text")


if __name__ == "__main__":
    main()
