"""Beam search and n > 1 completions on shared, copy-on-write KV blocks (chapter 11).

    ./beam_search_example.sh
    ./beam_search_example.sh --beam-width 8 --max-tokens 24 --prompt "KING LEAR."

Part 1 runs one beam search step by step and prints, after every step, each beam's tokens so far and
its block table: blocks held by several beams show their reference count, and a block copied on write
shows up as a new id in one beam's last place. Part 2 prints the finished sequences, best first.
Part 3 compares the KV blocks one request with n = 8 needs with what 8 separate requests of the same
prompt need (prefix caching off, so only forking shares).
"""

from __future__ import annotations

import argparse

from roseinfer import BeamSearchParams, LLMEngine, SamplingParams


def blocks_row(table: list[int], refs: dict[int, int]) -> str:
    return " ".join(f"{b}x{refs[b]}" if refs[b] > 1 else str(b) for b in table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="Romeo.\n")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    eng = LLMEngine(args.model, device=args.device, block_size=args.block_size, enable_prefix_caching=False)
    eng.trace = []
    params = BeamSearchParams(args.beam_width, args.max_tokens)
    eng.add_request("b", args.prompt, params)
    print(f"beam search, width {args.beam_width}, block size {args.block_size}; prompt {args.prompt!r}")
    print("after each step: beam, its generated tokens, its block table (NxR = block N held by R beams)\n")
    result = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            result = out
        t = eng.trace[-1]
        print(f"step {t['step']}: {len(t['preempted_req_ids'])} preempted, "
              f"{len(t.get('ref_counts', {}))} blocks in use")  # fmt: skip
        for beam, tokens in t["groups"].get("b", {}).items():  # the beams: "b", "b#1", ... and their tokens
            table = t["block_tables"].get(beam)
            if table is not None:
                ids = " ".join(map(str, tokens[-6:]))
                print(f"  {beam:<5} ...{ids:<28} blocks {blocks_row(table, t['ref_counts'])}")
    print("\nfinished sequences, best first (score = cum_logprob / length ** length_penalty):")
    for c in result.outputs:
        print(f"  {c.cumulative_logprob / len(c.token_ids) ** params.length_penalty:8.4f}  {c.text!r}")

    print("\nKV blocks of one request with n = 8 against 8 separate requests of the same prompt:")
    prompt_ids = eng.tokenizer.encode(args.prompt * 8)
    for name, n, copies in (("n = 8", 8, 1), ("8 requests", 1, 8)):
        e = LLMEngine(args.model, device=args.device, block_size=args.block_size, enable_prefix_caching=False)
        for i in range(copies):
            e.add_request(str(i), prompt_ids, SamplingParams(temperature=0.8, seed=i, max_tokens=8, n=n))
        peak = 0
        while e.has_unfinished_requests():
            e.step()
            peak = max(peak, e.get_stats()["kv_blocks_used"])
        print(f"  {name:<11} prompt {len(prompt_ids)} tokens: at most {peak} KV blocks in use")


if __name__ == "__main__":
    main()
