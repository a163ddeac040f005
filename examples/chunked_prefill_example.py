"""A long prompt arrives while short requests decode: watch it prefill in chunks (chapter 09).

    ./chunked_prefill_example.sh
    ./chunked_prefill_example.sh --budget 64 --long-prompt-tokens 300
    ./chunked_prefill_example.sh --no-chunking

Every step is one forward pass over at most `--budget` tokens. Running requests go first (one
token each), and the long prompt gets what is left of the budget, chunk after chunk, until its
whole prompt is in the KV cache; then it samples its first token and decodes like the others.
With `--no-chunking` its whole prompt has to fit one step, so the budget must hold the model's
context, and that one step carries the whole prompt next to the decodes. At the end each request's
tokens are compared with the same request run alone (its whole prompt in one step) on a second engine.
"""

from __future__ import annotations

import argparse

from roseinfer import LLM, LLMEngine, SamplingParams

SHORT = {"a": "Romeo.\n", "b": "Juliet.\n", "c": "Nurse.\n"}
TEXT = "Enter Hamlet, reading.\n\nPolonius.\nWhat do you read, my lord?\n\nHamlet.\nWords, words, words.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", type=int, default=32, help="max_num_batched_tokens: tokens per step")
    ap.add_argument("--long-prompt-tokens", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=12, help="new tokens per request")
    ap.add_argument("--arrives-at", type=int, default=3, help="step after which the long prompt arrives")
    ap.add_argument("--no-chunking", action="store_true", help="enable_chunked_prefill=False")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    chunked = not args.no_chunking
    eng = LLMEngine(args.model, device=args.device, max_num_batched_tokens=args.budget,
                    enable_chunked_prefill=chunked)  # fmt: skip
    eng.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    long_ids = (eng.tokenizer.encode(TEXT) * 100)[: args.long_prompt_tokens]
    for rid, prompt in SHORT.items():
        eng.add_request(rid, prompt, params)
    names = [*SHORT, "long"]
    print(f"budget {args.budget} tokens per step, chunked prefill {'on' if chunked else 'off'}; "
          f"'long' ({len(long_ids)} prompt tokens) arrives after step {args.arrives_at}")  # fmt: skip
    print("new tokens computed per request in each step ('.' = not scheduled, * = sampled a token):\n")
    print(f"{'step':>4} {'tokens':>6}  " + "".join(f"{n:>9}" for n in names))
    done, step = {}, 0
    while eng.has_unfinished_requests() or step < args.arrives_at:
        if step == args.arrives_at:
            eng.add_request("long", long_ids, params)
        outs = eng.step()
        step += 1
        got = {o.request_id for o in outs}
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
        n = eng.trace[-1]["num_scheduled_tokens"]
        cells = []
        for rid in names:
            if rid not in n:
                cells.append(".")
            else:
                label = "chunk " if rid == "long" and n[rid] > 1 and rid not in got else ""
                cells.append(f"{label}{n[rid]}{'*' if rid in got else ''}")
        print(f"{step:>4} {sum(n.values()):>6}  " + "".join(f"{c:>9}" for c in cells))
    # each request alone, its whole prompt in one step, on a second engine with nothing shared
    ref = LLM(args.model, device=args.device, enable_chunked_prefill=False, enable_prefix_caching=False)
    solo = {
        rid: ref.generate([p], params, use_tqdm=False)[0].token_ids for rid, p in [*SHORT.items(), ("long", long_ids)]
    }
    same = sum(done[r] == solo[r] for r in solo)
    print(f"\n{step} steps; blocks in use after the run: {eng.get_stats()['kv_blocks_used']}")
    print("all outputs equal their solo runs" if same == len(solo) else f"only {same}/{len(solo)} equal solo runs!")


if __name__ == "__main__":
    main()
