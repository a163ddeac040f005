"""An OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine.

    roseinfer serve --port 8000                  # or: python -m roseinfer serve / ./serve.sh
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "roseinfer", "prompt": "Romeo.\\n", "max_tokens": 32, "stream": true}'

A request's path: the route parses and checks the JSON body (a bad field is an HTTP 400 with OpenAI's
error shape, before anything is queued), makes `SamplingParams`, and asks the AsyncLLMEngine for one
stream of outputs per prompt. Non-streaming, it waits for the last output and answers once; streaming,
every output becomes a server-sent event

    data: {"id": "cmpl-…", "object": "text_completion", "choices": [{"index": 0, "text": " the", …}]}

and the stream ends with `data: [DONE]`. A client that disconnects cancels the stream; that closes the
engine's generator, which aborts the request. `GET /metrics` is Prometheus text (roseinfer/entrypoints/metrics.py).
The engine hands the server only what is new at each step (RequestOutputKind.DELTA), so a long stream costs
no more per step than a short one.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.metrics import ServerMetrics
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import RequestOutputKind, SamplingParams

PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "ignore_eos"}
ACCEPTED = PARAMS | {"model", "prompt", "stream", "stream_options", "user"}
# OpenAI fields this server does not implement: accepted only with the value that means "off"
UNSUPPORTED = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "logit_bias": None,
               "presence_penalty": 0, "frequency_penalty": 0}  # fmt: skip


class APIError(Exception):
    """An error the client caused (4xx) or the server cannot take now (503), in OpenAI's shape."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


def build_app(engine: AsyncLLMEngine, model_name: str = "roseinfer", max_waiting: int = 1024) -> FastAPI:
    """The app. `max_waiting`: requests that may wait for the engine before new ones get HTTP 503."""
    metrics = ServerMetrics(model_name)
    engine.on_step = metrics.on_step

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="roseinfer", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "roseinfer"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from e
        prompts, params, stream, include_usage = parse_completion_request(body, model_name, engine)
        if engine.num_waiting + len(prompts) > max_waiting:
            raise APIError(503, f"server busy: {engine.num_waiting} requests are waiting (limit {max_waiting}); "
                                "retry later", "ServiceUnavailableError")  # fmt: skip
        rid = f"cmpl-{uuid.uuid4().hex}"
        merged = merge_streams(engine, metrics, rid, prompts, params)
        try:  # wait for the first output: an error the engine finds is then still a 400, not a broken stream
            first = await until_disconnect(request, merged.__anext__())
        except ValueError as e:
            await merged.aclose()
            raise APIError(400, str(e)) from e
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the requests are already aborted
        chunks = completion_chunks(first, merged, rid, model_name, params.n, prompts)
        if stream:
            return StreamingResponse(sse(chunks, include_usage), media_type="text/event-stream")
        try:
            return JSONResponse(await until_disconnect(request, collect(chunks)))
        except ClientDisconnected:
            return Response(status_code=499)

    return app


def parse_completion_request(body, model_name: str, engine: AsyncLLMEngine):
    """Check the JSON body of /v1/completions; returns (each prompt's token ids, SamplingParams, stream,
    include_usage)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED - set(UNSUPPORTED))
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    for key, off in UNSUPPORTED.items():
        if body.get(key, off) not in (off, None):
            raise APIError(400, f"{key} is not supported by this server", param=key)
    if body.get("model", model_name) != model_name:
        raise APIError(404, f"The model `{body['model']}` does not exist.", "NotFoundError", "model")
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {stream!r}", param="stream")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, 'stream_options must be an object like {"include_usage": true}', param="stream_options")
    prompts = body.get("prompt")
    if prompts is None:
        raise APIError(400, "prompt is required", param="prompt")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt: a string or a list of token ids
    if not isinstance(prompts, list) or not prompts:
        raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of those",
                       param="prompt")  # fmt: skip
    kwargs = {k: body[k] for k in PARAMS if k in body and body[k] is not None}
    kwargs.setdefault("max_tokens", 16)  # OpenAI's default for completions
    try:
        params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from e
    n_ctx = engine.engine.config.model_config.max_model_len
    prompt_ids = []
    for i, prompt in enumerate(prompts):
        try:  # the same checks LLMEngine.add_request makes, before anything is queued
            ids = engine.engine.check_request(prompt, params)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"prompt {i}: {e}" if len(prompts) > 1 else str(e), param="prompt") from e
        if len(ids) + params.max_tokens > n_ctx:
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the "
                                f"prompt, {params.max_tokens} for the completion).", param="max_tokens")  # fmt: skip
        prompt_ids.append(ids)  # the engine gets the ids: a prompt is tokenized once
    return prompt_ids, params, stream, options.get("include_usage", False)


async def merge_streams(engine: AsyncLLMEngine, metrics: ServerMetrics, rid: str, prompts: list, params):
    """One engine request per prompt; yields (prompt index, RequestOutput) as any of them progresses, and
    records each request's latencies. Closing this generator cancels (and so aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt) -> None:
        arrival, first, tokens, last = time.perf_counter(), None, 0, None
        try:
            async for out in engine.generate(prompt, params, request_id=f"{rid}-{i}"):
                new = sum(len(c.token_ids) for c in out.outputs)  # the step's new tokens (DELTA outputs)
                if first is None and new:
                    first = time.perf_counter()
                tokens += new
                last = out
                queue.put_nowait((i, out))
            metrics.on_finish(last.finish_reason, len(last.prompt_token_ids), tokens, arrival, first,
                              time.perf_counter())  # fmt: skip
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        done = 0
        while done < len(tasks):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # closes the engine generators: unfinished requests are aborted before the next step
        await asyncio.gather(*tasks, return_exceptions=True)


async def completion_chunks(first, merged, rid: str, model: str, n: int, prompts: list) -> AsyncIterator[dict]:
    """Turn (prompt index, RequestOutput) items into OpenAI chunk objects, one per choice that has new text
    or has just finished; choice index = prompt index * n + completion index. The last item is the usage."""
    created, sent, done, prompt_tokens = int(time.time()), {}, set(), {}

    async def items():
        yield first
        async for item in merged:
            yield item

    try:
        async for i, out in items():
            for chunk in _choice_chunks(i, out, sent, done, rid, created, model, n):
                yield chunk
            prompt_tokens[i] = len(out.prompt_token_ids)
    finally:
        await merged.aclose()  # a consumer that stops early (a disconnect) aborts the requests now
    yield {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": sum(prompt_tokens.values())},
    }  # completion tokens: filled in by the caller


def _choice_chunks(i: int, out: RequestOutput, sent: dict, done: set, rid, created, model, n) -> list[dict]:
    """The chunks one step's output gives: a choice per completion with new text, or that just finished.
    `sent` counts each choice's tokens so far (for the usage)."""
    chunks = []
    for c in out.outputs:
        key = (i, c.index)
        sent[key] = sent.get(key, 0) + len(c.token_ids)
        finished = c.finish_reason is not None and key not in done
        if not c.text and not finished:
            continue
        if finished:
            done.add(key)
        choice = {"index": i * n + c.index, "text": c.text, "logprobs": None,
                  "finish_reason": c.finish_reason if finished else None}  # fmt: skip
        chunks.append({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice], "_tokens": (key, sent[key])})  # fmt: skip
    return chunks


async def sse(chunks: AsyncIterator[dict], include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: `data: <json>` and a blank line per chunk, then `data: [DONE]`."""
    tokens = {}
    try:
        async for chunk in chunks:
            if "usage" in chunk:
                if include_usage:
                    yield f"data: {json.dumps(with_usage(chunk, tokens))}\n\n"
                continue
            key, count = chunk.pop("_tokens")
            tokens[key] = count
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as e:  # the engine failed mid-stream: tell the client in the stream itself
        err = {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError", "param": None, "code": 500}
        yield f"data: {json.dumps({'error': err})}\n\n"
    finally:
        await chunks.aclose()  # runs also when the client went away: the requests are aborted at once
    yield "data: [DONE]\n\n"


async def collect(chunks: AsyncIterator[dict]) -> dict:
    """The non-streaming answer: every choice's whole text, in index order, and the usage."""
    texts, reasons, tokens, last = {}, {}, {}, None
    async for chunk in chunks:
        if "usage" in chunk:
            last = with_usage(chunk, tokens)
            continue
        key, tokens[key] = chunk.pop("_tokens")
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    choices = [{"index": k, "text": texts[k], "logprobs": None, "finish_reason": reasons[k]} for k in sorted(texts)]
    return {k: v for k, v in last.items() if k != "usage"} | {"choices": choices, "usage": last["usage"]}


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, awaitable):
    """Await, but give up (cancelling it, which aborts the requests) if the client disconnects meanwhile:
    a handler that is not streaming yet is not cancelled by the server when its client goes away."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait([task], timeout=0.1)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
    try:
        return task.result()
    except (APIError, ValueError):
        raise
    except Exception as e:  # the engine failed: a 500 in OpenAI's shape
        raise APIError(500, f"{type(e).__name__}: {e}", "InternalServerError") from e


def with_usage(chunk: dict, tokens: dict) -> dict:
    usage = chunk["usage"] | {"completion_tokens": sum(tokens.values())}
    return chunk | {"usage": usage | {"total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}
