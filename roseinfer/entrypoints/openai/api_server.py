"""An OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine (vLLM's entrypoints/openai/api_server.py).

    roseinfer serve --port 8000                  # or: python -m roseinfer serve / ./serve.sh
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hail!"}], "max_tokens": 32, "stream": true}'

    route                      module                     notes
    POST /v1/completions       serving_completion.py     prompts in, text out (SSE with "stream": true)
    POST /v1/chat/completions  serving_chat.py           messages through the chat template
    GET  /v1/models            here                      the one served model
    POST /tokenize, /detokenize serving_tokenization.py   the server's tokenizer, over HTTP
    GET  /health, /version     here                      503 while shutting down / {"version": ...}
    GET  /metrics              metrics.py                Prometheus text, vLLM's metric names
    GET  /openapi.json, /docs  FastAPI                   the request models of protocol.py

Around the routes: the API key and the body limit (middleware.py), a JSON reader that refuses what could hurt
(middleware.py), and one error shape for every failure (errors.py). With `--api-key`, every /v1 route needs
`Authorization: Bearer KEY`; the others stay open, as in vLLM. Shutting down (launcher.py) drains first. With
`--request-timeout S`, a generating request still unfinished S seconds after it arrived is aborted and answered
504 (serving_engine.py says why 504).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import roseinfer
from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.metrics import ServerMetrics
from roseinfer.entrypoints.openai.errors import APIError, add_exception_handlers
from roseinfer.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware, CheckedJSONRoute
from roseinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from roseinfer.entrypoints.openai.serving_chat import OpenAIServingChat
from roseinfer.entrypoints.openai.serving_completion import OpenAIServingCompletion
from roseinfer.entrypoints.openai.serving_engine import ServerState
from roseinfer.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from roseinfer.entrypoints.openai.tool_parsers import ToolParser

MAX_REQUEST_BODY_BYTES = 10 * 2**20  # 10 MiB: a prompt far longer than any context still fits
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503, 504)}  # documented in OpenAPI


def build_app(engine: AsyncLLMEngine, model_name: str = "roseinfer", max_waiting: int = 1024, *,
              api_key: str | None = None, chat_template: str | None = None,
              tool_parser: type[ToolParser] | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
              request_timeout: float | None = None) -> FastAPI:  # fmt: skip
    """The app. `max_waiting`: requests that may wait for the engine before new ones get HTTP 503;
    `chat_template`: a Jinja template that replaces the model's own; `api_key`: required on /v1 routes;
    `tool_parser`: reads the model's tool calls for tool_choice "auto" (None: "auto" is refused);
    `request_timeout`: seconds from a request's arrival after which it is aborted and answered 504 (None: never)."""
    config = engine.engine.config.model_config
    metrics = ServerMetrics(model_name, config.max_model_len, engine.engine.config.speculative_config is not None)
    engine.stat_logger = metrics.record
    state = ServerState()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="roseinfer", version=roseinfer.__version__, lifespan=lifespan)
    app.router.route_class = CheckedJSONRoute
    app.state.engine, app.state.metrics, app.state.server = engine, metrics, state
    add_exception_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # added last: runs first, before the body is read
    common, limit = (engine, model_name, max_waiting, state), {"request_timeout": request_timeout}
    completion = OpenAIServingCompletion(*common, **limit)
    chat = OpenAIServingChat(*common, chat_template=chat_template, tool_parser=tool_parser, **limit)
    tokenization = OpenAIServingTokenization(*common, chat=chat)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.draining else 200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=roseinfer.__version__)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        card = ModelCard(id=model_name, created=int(time.time()), root=str(config.model_dir),
                         max_model_len=config.max_model_len)  # fmt: skip
        return ModelList(data=[card])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await tokenization.create_tokenize(request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.create_detokenize(request)

    return app


def begin_drain(app: FastAPI) -> None:
    """Take no new request (503); the ones in flight go on."""
    app.state.server.draining = True


def end_streams(app: FastAPI, why: str) -> None:
    """End every request in flight now: a stream gets an error event and [DONE], a waiting request a 503."""
    app.state.engine.abort_all(APIError(503, f"the server is shutting down ({why}): the request was cut short"))
