"""Speculative decoding, step by step (chapter 14).

    ./spec_decode_example.sh
    ./spec_decode_example.sh --method draft_model -k 8 --max-tokens 48

Part 1 runs one greedy request with speculation and prints its first steps: the drafts the proposer
guessed, how many the target accepted, and the tokens the step produced (the accepted drafts, then
the target's own token). Part 2 runs the same requests without speculation, with the n-gram proposer
and with the bundled draft model, and checks that the three produce the same tokens; it prints how
many forward passes of the target each needed and the acceptance statistics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import finished_tokens
from roseinfer import LLMEngine, SamplingParams

DRAFT = str(Path(__file__).resolve().parents[1] / "roseinfer" / "models" / "tiny-shakespeare-draft")
PROMPTS = ["KING.\nThou art the ruler of this land.\nQUEEN.\nThen serve me well.\nKING.\n", "Enter Romeo.\n\nROMEO.\n",
           "First Citizen.\nBefore we proceed any further, hear me speak.\n"]  # fmt: skip


def config(method: str | None, k: int) -> dict | None:
    if method is None:
        return None
    return {"method": method, "num_speculative_tokens": k} | ({"model": DRAFT} if method == "draft_model" else {})


def run(method: str | None, args, prompts: list[str]) -> tuple[LLMEngine, dict[str, list[int]]]:
    eng = LLMEngine(device="cpu", dtype="float32", speculative_config=config(method, args.k))
    eng.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    return eng, finished_tokens(eng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--steps", type=int, default=24, help="steps of part 1 to print")
    args = ap.parse_args()

    eng = LLMEngine(device="cpu", dtype="float32", speculative_config=config(args.method, args.k))
    eng.trace = []
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    print(f"1. one request, {args.method}, k = {args.k}: its first {args.steps} steps")
    print(f"   prompt {PROMPTS[0]!r}")
    done = 0
    while eng.has_unfinished_requests() and eng.num_steps < args.steps:
        outs = eng.step()
        t = eng.trace[-1]
        new = outs[0].token_ids[done:] if outs else []
        done += len(new)
        drafts = t["scheduled_spec_decode_tokens"].get("0", [])
        m = next((i for i, (d, x) in enumerate(zip(drafts, new, strict=False)) if d != x), min(len(drafts), len(new)))
        pieces = " ".join(repr(eng.tokenizer.decode([d])) for d in drafts) or "-"
        print(f"   step {t['step']:2d}  rows {t['num_scheduled_tokens']['0']:2d}  drafts {pieces:44s} "
              f"accepted {m}/{len(drafts)} -> {eng.tokenizer.decode(new)!r}")  # fmt: skip
    print()
    plain, plain_tokens = run(None, args, PROMPTS)
    print(f"2. {len(PROMPTS)} requests, {args.max_tokens} tokens each, greedy")
    print("   proposer       target forwards  drafts checked  accepted  mean acceptance length  same tokens")
    print(f"   {'none':14s} {plain.num_steps:15d}")
    ok = True
    for method in ("ngram", "draft_model"):
        spec, spec_tokens = run(method, args, PROMPTS)
        s = spec.get_stats()
        same = spec_tokens == plain_tokens
        ok &= same
        print(
            f"   {method:14s} {spec.num_steps:15d} {s['spec_decode_num_draft_tokens']:15d} "
            f"{s['spec_decode_num_accepted_tokens']:9d} {s['spec_decode_mean_acceptance_length']:23.2f}  {same}"
        )
    if not ok:
        raise SystemExit("speculative decoding changed the output")


if __name__ == "__main__":
    main()
