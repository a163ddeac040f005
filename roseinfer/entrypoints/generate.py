"""Command line: `python -m roseinfer.entrypoints.generate --prompt "Romeo."` streams a continuation (./generate.sh)."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "Romeo.\nBut soft! what light through yonder window breaks?\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="./generate.sh", description="Continue a prompt with GPT-2.")
    ap.add_argument("--model", default=None, help="model directory or Hub id (default: the bundled model)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=40, help="-1 = no top-k filter")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: fp32 on CPU)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.sampling_params import RequestOutputKind, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_new_tokens,
            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        engine = LLMEngine(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1)
        engine.add_request("0", args.prompt, params)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.prompt, end="", flush=True)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.text, end="", flush=True)  # each delta as soon as it is final
            n += len(out.token_ids)
    dt = time.perf_counter() - t0
    print(f"\n\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
