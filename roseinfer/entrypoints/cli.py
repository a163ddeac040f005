"""The `roseinfer` command (also `python -m roseinfer`): `roseinfer serve` starts the OpenAI-compatible server.

    roseinfer serve                                   # the bundled model on 127.0.0.1:8000
    roseinfer serve --model path/to/gpt2 --port 8001 --max-num-seqs 32 --preemption-mode swap
    roseinfer serve --tensor-parallel-size 2          # the model split across 2 processes

The engine's flags are `EngineArgs`' fields with dashes (vLLM's spelling), made from the one definition in
roseinfer/config.py.
"""

from __future__ import annotations

import argparse

from roseinfer.config import EngineArgs


def serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: roseinfer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before new ones get HTTP 503")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    EngineArgs.add_cli_args(p)
    return p


def serve(args: argparse.Namespace) -> None:
    import torch
    import uvicorn

    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.entrypoints.api_server import build_app
    from roseinfer.entrypoints.async_engine import AsyncLLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineArgs.from_cli_args(args).create_engine_config())
    app = build_app(AsyncLLMEngine(engine), args.served_model_name or "roseinfer", args.max_waiting)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()  # the tensor-parallel workers stop with the server


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
