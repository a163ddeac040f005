"""Run several prompts through `LLM.generate` and print each result (chapter 03).

./offline_example.sh
./offline_example.sh --prompts "Romeo." "Juliet." --temperature 0 --max-tokens 32
./offline_example.sh --timeline      # also print which request ran at each step
"""

from __future__ import annotations

import argparse
import time

from roseinfer import LLM, SamplingParams

DEFAULT_PROMPTS = [
    "Romeo.\n",
    "Enter the Ghost.\n\nHamlet.\n",
    "KING LEAR.\nBlow, winds, and crack your cheeks!",
    "Portia.\nThe quality of mercy is not strain'd,\n",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--timeline", action="store_true", help="print which request runs at each step")
    args = ap.parse_args()

    llm = LLM(model=args.model, device=args.device, max_num_seqs=max(64, len(args.prompts)))
    params = [
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       max_tokens=args.max_tokens, seed=args.seed + i, stop=args.stop)
        for i in range(len(args.prompts))
    ]  # fmt: skip
    t0 = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    for i, out in enumerate(outputs):
        print(f"### request {i}")
        print(out.prompt + out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {n} output tokens in {dt:.2f}s ({n / dt:.1f} tokens/s)")

    if args.timeline:  # the same requests again, one engine step at a time, recorded in the engine's trace
        eng = llm.llm_engine
        eng.trace = []
        for i, (prompt, p) in enumerate(zip(args.prompts, params, strict=True)):
            eng.add_request(str(i), prompt, p)  # all admitted in the first step (max_num_seqs is large enough)
        print("\nstep | requests advanced (in order)")
        step = 0
        while eng.has_unfinished_requests():
            step += 1
            eng.step()
            ran = eng.trace[-1]["ran"]  # every request scheduled in this step: one forward for all of them
            if step <= 3 or not eng.has_unfinished_requests() or len(ran) < len(args.prompts):
                print(f"{step:4d} | " + " ".join(ran))


if __name__ == "__main__":
    main()
