"""What every generating route shares (vLLM's OpenAIServing): checks, admission, the engine streams, SSE.

A request's path through it, each step able to refuse it with its own status:

    check_model / check_unsupported / make_sampling_params         400 / 404, nothing queued yet
    check_num_prompts                                              400: more prompts than ever fit the queue
    tokenize (a thread) + check_context                            400: too long, bad ids, can never fit
    admit                                                          503: busy now (retry later), or shutting down
    start_streams: one engine request per prompt, wait for the first output
    stream (SSE) or collect (one JSON)                             504: not done within --request-timeout

A request that can never be served is a 4xx, whatever the load; 503 only ever means "not now". Once a stream
has started its status is sent, so a later failure (the engine's step failed, the server shuts down, the
request ran out of time) ends the stream with an error event in OpenAI's shape, then `data: [DONE]`: the
client learns why instead of reading a cut connection. A client that disconnects cancels the stream: the
cancellation closes `merge_streams`, which closes every `AsyncLLMEngine.generate`, which aborts the requests
before the next step. A request past its deadline (`request_timeout_error`) takes the same path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from roseinfer.entrypoints.async_engine import AsyncLLMEngine
from roseinfer.entrypoints.openai.errors import APIError, error_body
from roseinfer.entrypoints.openai.protocol import UNSUPPORTED, SamplingRequest
from roseinfer.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ServerState:
    """Shared by the routes and the launcher: a draining server takes no new request."""

    draining: bool = False


class ClientDisconnected(Exception):
    pass


def request_timeout_error(limit: float) -> APIError:
    """What a request gets when it is not done `limit` seconds (--request-timeout) after it arrived: 504.

    Why 504 Gateway Timeout and not 408 Request Timeout. 408 says the *client* was too slow to send its
    request (RFC 9110 §15.5.9: the server "did not receive a complete request message" in time); here the
    request came whole and was valid, and it is the server that could not answer in time. A 4xx would blame
    the client, and dashboards that count 5xx as the server's failures would not see it. 504 is what a server
    in front of another one answers when a deadline of its own passes (nginx's and Envoy's route timeouts, gRPC's
    DEADLINE_EXCEEDED over HTTP), and this HTTP layer is such a front to its engine. Unlike 503 it is no
    refusal at the door: the request was admitted and worked on. Overload does not produce it by default: with
    no --request-timeout (the default) the bounded queue's 503 stays the only 5xx a busy server sends. vLLM's
    server has no such limit; the body is OpenAI's error shape, as for every other error."""
    return APIError(504, f"request exceeded --request-timeout {limit:g} s: it was aborted")


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_waiting: int, state: ServerState,
                 request_timeout: float | None = None):  # fmt: skip
        """`request_timeout`: seconds from a request's arrival to its end (None: no limit)."""
        self.engine, self.model_name, self.max_waiting, self.state = engine, model_name, max_waiting, state
        self.request_timeout = request_timeout
        self.max_model_len = engine.engine.config.model_config.max_model_len
        self.tokenizer = engine.engine.tokenizer

    def token_text(self, token_id: int) -> str:
        """One token's own text (its bytes, decoded with errors="replace")."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        table = self.tokenizer.token_bytes_table
        return table[token_id] if 0 <= token_id < len(table) else b""

    # ---- checks before anything is queued ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    @staticmethod
    def check_unsupported(request: SamplingRequest) -> None:
        for name, offs in UNSUPPORTED.items():
            value = getattr(request, name, None)
            if value is not None and not any(type(value) is type(off) and value == off for off in offs):
                raise APIError(400, f"{name} is not supported by this server", name)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options can only be given with stream: true", "stream_options")

    @staticmethod
    def make_sampling_params(kwargs: dict) -> SamplingParams:
        """SamplingParams' own checks give the 400s, with their messages (they start with the field's name)."""
        try:
            return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), str(e).split()[0]) from e

    def check_num_prompts(self, num_prompts: int) -> None:
        if num_prompts > self.max_waiting:
            raise APIError(400, f"the request has {num_prompts} prompts, more than this server ever queues at once "
                                f"({self.max_waiting}): send them in several requests", "prompt")  # fmt: skip

    async def tokenize(self, prompt, params: SamplingParams, where: str = "", constraint: str | None = None,
                       ) -> list[int]:  # fmt: skip
        """The prompt's token ids (tokenized in a thread: the event loop serves the streams meanwhile), checked
        as `LLMEngine.add_request` would check them, and against the context with `max_tokens`. `constraint`: the
        request field that gave params.structured_outputs, named if it does not compile."""
        try:
            ids = await self.engine.check_request(prompt, params)
        except (ValueError, TypeError) as e:
            if constraint is not None and str(e).startswith("structured_outputs"):
                raise APIError(400, f"{constraint}: {e}", constraint) from e
            raise APIError(400, f"{where}{e}", "prompt") from e
        self.check_context(len(ids), params.max_tokens)
        return ids

    def check_context(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages/prompt, "
                                f"{max_tokens} for the completion).", "max_tokens")  # fmt: skip

    def admit(self, num_prompts: int) -> None:
        """503 when the server cannot take it now: shutting down, or too many requests waiting already (with
        `Retry-After: 1`, the seconds a client should wait: about the time a few steps free the queue)."""
        if self.state.draining:
            raise APIError(503, "the server is shutting down; retry on another replica or later")
        waiting = self.engine.num_waiting
        if waiting + num_prompts > self.max_waiting:
            raise APIError(503, f"server busy: {waiting} requests are waiting (limit {self.max_waiting}); retry later",
                           headers={"Retry-After": "1"})  # fmt: skip

    # ---- the engine's streams -----------------------------------------------------------------------------------
    async def start_streams(self, raw: Request, rid: str, prompts: list[list[int]], params: SamplingParams,
                            arrival: float):  # fmt: skip
        """One engine request per prompt, merged; waits for the first output, so that an error the engine finds
        is still an HTTP error rather than a broken stream. Returns (first item, the merged stream)."""
        merged = merge_streams(self.engine, rid, prompts, params, arrival, self.request_timeout)
        try:
            return await until_disconnect(raw, merged.__anext__()), merged
        except BaseException:
            await merged.aclose()
            raise


async def merge_streams(engine: AsyncLLMEngine, rid: str, prompts: list, params: SamplingParams, arrival: float,
                        timeout: float | None = None):  # fmt: skip
    """One engine request per prompt; yields (prompt index, RequestOutput) as any of them progresses. Closing
    this generator cancels (and so aborts) them all. An error of one prompt is raised, naming the prompt.

    `timeout`: seconds after `arrival` (time.perf_counter()) when one timer goes off: it cancels the prompts'
    engine requests at once, so their blocks come back before the next step even if nobody reads this generator
    meanwhile (a slow client), and queues `request_timeout_error`, raised after the outputs already queued."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt) -> None:
        try:
            async for out in engine.generate(prompt, params, request_id=f"{rid}-{i}", arrival_time=arrival):
                queue.put_nowait((i, out))
        except (ValueError, TypeError) as e:
            queue.put_nowait((i, type(e)(f"prompt {i}: {e}" if len(prompts) > 1 else str(e))))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]

    def expire() -> None:
        for t in tasks:
            t.cancel()  # a cancelled pump puts nothing more: the error below is the last item
        queue.put_nowait((-1, request_timeout_error(timeout)))

    timer = None
    if timeout is not None:
        timer = asyncio.get_running_loop().call_later(max(0.0, arrival + timeout - time.perf_counter()), expire)
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
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()  # closes the engine generators: unfinished requests are aborted before the next step
        await asyncio.gather(*tasks, return_exceptions=True)


async def chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def listen_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (vLLM's name). Once the body is read, the ASGI server's next message is
    `http.disconnect`, sent only then: one task asleep per request, woken once."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable):
    """Await, but give up (cancelling it, which aborts the requests) if the client disconnects meanwhile:
    a handler that is not streaming yet is not cancelled by the server when its client goes away.

    The disconnect is awaited (`listen_for_disconnect`), not polled: polling `request.is_disconnected()` every
    0.1 s cost the event loop ten wake-ups a second per request, 10,000 a second with 1,000 requests queued under
    overload, and /health and /metrics waited behind them."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this handler is being cancelled): stop, abort the requests
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    try:
        return task.result()
    except APIError:
        raise
    except (ValueError, TypeError) as e:  # found by the engine when it took the request
        raise APIError(400, str(e)) from e
    except Exception as e:  # the engine failed: a 500 in OpenAI's shape
        raise APIError(500, f"{type(e).__name__}: {e}") from e


def sse_error(e: BaseException) -> dict:
    if isinstance(e, APIError):
        return e.body()
    if isinstance(e, (ValueError, TypeError)):
        return error_body(400, str(e))
    return error_body(500, f"{type(e).__name__}: {e}")


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: `data: <json>` and a blank line per chunk, then `data: [DONE]`. An error after the
    stream started is sent as one more event, `data: {"error": {...}}`, before `data: [DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as e:  # the engine failed, or the server shuts down: tell the client in the stream itself
        yield f"data: {json.dumps(sse_error(e))}\n\n"
    finally:
        await chunks.aclose()  # runs also when the client went away: the requests are aborted at once
    yield "data: [DONE]\n\n"


def with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens)
