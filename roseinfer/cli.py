"""The `roseinfer` command (also `python -m roseinfer`): `roseinfer serve` starts the OpenAI-compatible server.

    roseinfer serve                                   # the bundled model on 127.0.0.1:8000
    roseinfer serve --model path/to/gpt2 --port 8001 --max-num-seqs 32 --preemption-mode swap
    roseinfer serve --tensor-parallel-size 2          # the model split across 2 processes (stage 15)

Engine flags are LLMEngine's arguments with dashes (vLLM's spelling).
"""

from __future__ import annotations

import argparse
import json


def serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument("--model", default=None, help="model directory or Hub id (default: the bundled model)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: roseinfer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before new ones get HTTP 503")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    p.add_argument("--swap-space", type=float, default=4, help="GiB of host memory for swapped KV blocks")
    p.add_argument("--watermark", type=float, default=0.01)
    spec = """speculative decoding, as JSON: '{"method": "ngram", "num_speculative_tokens": 4}'"""
    p.add_argument("--speculative-config", type=json.loads, default=None, help=spec)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="processes that share the model (stage 15)")
    return p


def serve(args: argparse.Namespace) -> None:
    import torch
    import uvicorn

    from roseinfer.async_engine import AsyncLLMEngine
    from roseinfer.llm_engine import LLMEngine
    from roseinfer.server import build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        args.model, device=args.device, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        watermark=args.watermark, preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
    )  # fmt: skip
    app = build_app(AsyncLLMEngine(engine), args.served_model_name or "roseinfer", args.max_waiting)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()  # stage 15: the tensor-parallel workers stop with the server


def main(argv: list[str] | None = None) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="roseinfer", description=__doc__, formatter_class=fmt)
    sub = ap.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
