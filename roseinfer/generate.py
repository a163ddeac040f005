"""Command line: `python -m roseinfer.generate --prompt "ROMEO:"`."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "Romeo.\nBut soft! what light through yonder window breaks?\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m roseinfer.generate", description="Continue a prompt with GPT-2.")
    ap.add_argument("--model", default=None, help="model directory or Hub id (default: the bundled model)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: fp32 on CPU)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from roseinfer.engine import InferenceEngine

    try:
        engine = InferenceEngine(args.model, device=args.device, dtype=args.dtype)
        t0 = time.perf_counter()
        ids = engine.generate_ids(engine.encode_prompt(args.prompt), args.max_new_tokens, args.temperature, args.seed)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    text = engine.tokenizer.decode([t for t in ids if t != engine.eos_token_id])
    print(args.prompt + text)
    print(f"\n[{len(ids)} tokens in {dt:.2f}s, {len(ids) / dt:.1f} tokens/s, no KV cache]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
