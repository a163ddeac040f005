"""The `roseinfer` command (also `python -m roseinfer`): `roseinfer serve` starts the OpenAI-compatible server.

    roseinfer serve                                   # the bundled model on 127.0.0.1:8000
    roseinfer serve --model path/to/gpt2 --port 8001 --max-num-seqs 32 --preemption-mode swap
    roseinfer serve --tensor-parallel-size 2          # the model split across 2 processes
    roseinfer serve --api-key KEY --chat-template chat.jinja --shutdown-timeout 10
    roseinfer serve --max-waiting 256 --request-timeout 60   # 503 past 256 waiting; 504 past 60 s per request
    roseinfer serve --allocator system                # glibc's malloc (default: tcmalloc/jemalloc if installed)
    roseinfer serve --no-warmup                       # start faster; oneDNN kernels built while serving
    roseinfer serve --enable-auto-tool-choice --tool-call-parser hermes   # tool_choice "auto": read the calls

The engine's flags are `EngineArgs`' fields with dashes (vLLM's spelling), made from the one definition in
roseinfer/config.py; the server's are below (vLLM's names where vLLM has the flag).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from roseinfer.config import EngineArgs
from roseinfer.entrypoints.allocator import CHOICES as ALLOCATOR_CHOICES
from roseinfer.entrypoints.allocator import restart_with_allocator


def serve_parser(sub) -> argparse.ArgumentParser:
    from roseinfer.entrypoints.openai.api_server import MAX_REQUEST_BODY_BYTES

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: roseinfer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("ROSEINFER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ROSEINFER_API_KEY)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template itself) instead of the model's own",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default when a request has tools): the model may call a tool in its own '
        "markup, which --tool-call-parser reads",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=tool_parser_names(),
        help="how the model writes a tool call (needed by --enable-auto-tool-choice)",
    )
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before new ones get HTTP 503")
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get HTTP 413 before they are read",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to finish the requests in flight after Ctrl-C / SIGTERM, before their streams end "
        "with an error event (a second Ctrl-C ends them at once)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="abort a completion or chat request still unfinished this long after it arrived, freeing its KV "
        "blocks at once, and answer HTTP 504 (a stream: an error event, then [DONE]); default: no limit",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--allocator",
        choices=ALLOCATOR_CHOICES,
        default="auto",
        help="preload a malloc that gives memory back (auto: tcmalloc, else jemalloc, when installed; "
        "system: glibc's), by starting the server again with LD_PRELOAD (roseinfer/entrypoints/allocator.py)",
    )
    EngineArgs.add_cli_args(p, defaults={"warmup": True})  # --no-warmup: start faster, grow under load
    return p


def positive_seconds(value: str) -> float:
    """argparse's `type` for a duration: a finite number of seconds > 0 ("0", "-1", "nan", "inf", "5s" are refused,
    and argparse names the flag in its error)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (0 < seconds < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def tool_parser_names() -> list[str]:
    from roseinfer.entrypoints.openai.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def auto_tool_parser(args: argparse.Namespace):
    """The parser class for tool_choice "auto", or None; --enable-auto-tool-choice needs --tool-call-parser."""
    from roseinfer.entrypoints.openai.tool_parsers import ToolParserManager

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser NAME (one of "
                         f"{', '.join(tool_parser_names())}): how the model writes a tool call")  # fmt: skip
    if not args.enable_auto_tool_choice:
        return None
    return ToolParserManager.get_tool_parser(args.tool_call_parser)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself if it is a template (has "{{" or "{%")."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def serve(args: argparse.Namespace) -> None:
    import torch

    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.entrypoints.async_engine import AsyncLLMEngine
    from roseinfer.entrypoints.openai.api_server import build_app
    from roseinfer.entrypoints.openai.launcher import serve_http

    if args.threads:
        torch.set_num_threads(args.threads)
    chat_template = read_chat_template(args.chat_template)
    tool_parser = auto_tool_parser(args)
    engine = LLMEngine.from_config(EngineArgs.from_cli_args(args).create_engine_config())
    app = build_app(AsyncLLMEngine(engine), args.served_model_name or "roseinfer", args.max_waiting,
                    api_key=args.api_key, chat_template=chat_template, tool_parser=tool_parser,
                    max_request_body_bytes=args.max_request_body_bytes,
                    request_timeout=args.request_timeout)  # fmt: skip
    try:
        serve_http(app, args.host, args.port, args.shutdown_timeout)
    finally:
        engine.close()  # the tensor-parallel workers stop with the server


def main(argv: list[str] | None = None) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="roseinfer", description=__doc__, formatter_class=fmt)
    sub = ap.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "serve":
        if argv is None:  # the command line itself (not a call from Python): start again on the allocator
            restart_with_allocator(sys.argv[1:], args.allocator)
        serve(args)


if __name__ == "__main__":
    main()
