"""Requests that share a system prompt: how many tokens each finds in the prefix cache (chapter 10).

    ./prefix_cache_example.sh
    ./prefix_cache_example.sh --num-requests 8 --block-size 8

Every request is the same system prompt plus its own question, and they arrive one after another,
a few engine steps apart. The script runs them twice on the same engine settings, once with prefix
caching and once without, and prints for each request its prompt length, the tokens whose K/V came
from the cache, the tokens it computed (the rest of its prompt, then one per generated token), and its
time to first token (TTFT). The outputs of the two runs must be the same: the cache changes how much
is computed, never what is generated.
"""

from __future__ import annotations

import argparse
import time

from roseinfer import LLMEngine, SamplingParams

SYSTEM = (
    "You are the Prince of Denmark. Answer every question in blank verse, briefly, as Hamlet would "
    "answer it on the battlements of Elsinore at midnight, with the Ghost of his father near, and "
    "Horatio at his side, and the cold wind blowing off the sea.\n\n"
)
QUESTIONS = ["Who are you?", "Where is Ophelia?", "What news from Wittenberg?", "Is the King well?",
             "What do you read, my lord?", "Shall we to the play?", "Why do you wear black?",
             "What is a man?"]  # fmt: skip


def run(args, caching: bool) -> tuple[dict, dict[str, str]]:
    eng = LLMEngine(args.model, device=args.device, block_size=args.block_size, enable_prefix_caching=caching)
    eng.add_request("warm-up", "Horatio.", SamplingParams(max_tokens=2))  # first steps of a process are slow
    while eng.has_unfinished_requests():
        eng.step()
    eng.reset_prefix_cache()
    eng.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = {f"q{i}": SYSTEM + QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_requests)}
    arrive = {rid: i * args.every for i, rid in enumerate(prompts)}
    added, first, done, step = {}, {}, {}, 0
    while len(done) < len(prompts):
        for rid, at in arrive.items():
            if at == step:
                eng.add_request(rid, prompts[rid], params)
                added[rid] = time.perf_counter()
        for out in eng.step() if eng.has_unfinished_requests() else []:
            first.setdefault(out.request_id, time.perf_counter() - added[out.request_id])
            if out.finished:
                done[out.request_id] = out
        step += 1
    computed = {rid: sum(t["num_scheduled_tokens"].get(rid, 0) for t in eng.trace) for rid in prompts}
    rows = {rid: (len(done[rid].prompt_token_ids), done[rid].num_cached_tokens, computed[rid], first[rid] * 1e3)
            for rid in prompts}  # fmt: skip
    return rows, {rid: o.text for rid, o in done.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--every", type=int, default=3, help="a new request arrives every this many steps")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    off, off_texts = run(args, caching=False)
    on, on_texts = run(args, caching=True)
    print(f"{args.num_requests} requests, one every {args.every} steps, each = the same system prompt + its own "
          f"question; block size {args.block_size}\n")  # fmt: skip
    print(
        f"{'request':<8} {'prompt':>6}   {'cached':>6} {'computed':>8} {'TTFT ms':>8}   {'computed':>8} {'TTFT ms':>8}"
    )
    print(f"{'':<8} {'tokens':>6}   {'-- with prefix caching --':>24}   {'-- without --':>17}")
    for rid in on:
        n, cached, comp, ttft = on[rid]
        _, _, comp_off, ttft_off = off[rid]
        print(f"{rid:<8} {n:>6}   {cached:>6} {comp:>8} {ttft:>8.1f}   {comp_off:>8} {ttft_off:>8.1f}")
    hits, queries = sum(r[1] for r in on.values()), sum(r[0] for r in on.values())
    print(f"\nprefix cache: {hits} of {queries} prompt tokens hit ({hits / queries:.0%}); tokens computed: "
          f"{sum(r[2] for r in on.values())} with caching, {sum(r[2] for r in off.values())} without")  # fmt: skip
    same = on_texts == off_texts
    print("outputs equal with and without the prefix cache" if same else "OUTPUTS DIFFER with and without the cache!")


if __name__ == "__main__":
    main()
