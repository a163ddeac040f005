"""What stands between a socket and a route: the API key, the body's size, and a JSON reader that cannot be hurt.

    request ──► APIKeyMiddleware ──► BodyLimitMiddleware ──► route (CheckedJSONRoute) ──► handler
                /v1/* without        Content-Length over      the body as JSON: strict,
                "Bearer KEY": 401    the limit: 413 at once;  not too deep, no lone
                                     a chunked body: 413 as   surrogates; else 400
                                     soon as it passes it

Three ways a body can hurt a Python server, each closed here:

    {"a": [[[[ ... 100,000 deep     json.loads recurses per level: RecursionError, a 500 from any handler
                                    that catches only JSONDecodeError. Here: 400, "nested too deeply".
    {"model": "\\ud800"}             a lone UTF-16 surrogate is a valid JSON escape and a valid Python str, but
                                    it cannot be encoded as UTF-8: the tokenizer, or the error message that
                                    quotes it, fails later with a 500. Here: 400 at the door, naming where.
    {"temperature": NaN}            Python's json reads NaN and Infinity, which JSON does not have. Here: 400.

Both middlewares are plain ASGI (a class with `__call__(scope, receive, send)`): they answer before any body
is read, and see chunked bodies chunk by chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.entrypoints.openai.errors import APIError, error_response

MAX_JSON_DEPTH = 64  # far deeper than any request needs (a chat message's content part is 4 levels down)
BIG_BODY = 1 << 20  # bodies past 1 MiB are parsed in a thread: the event loop keeps serving streams


class APIKeyMiddleware:
    """`/v1/*` needs `Authorization: Bearer KEY`; the rest (/health, /metrics, /version, /tokenize ...) stays
    open, as in vLLM, for load balancers and scrapers. The key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self._expected = app, hashlib.sha256(f"Bearer {api_key}".encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._expected):
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            return await error_response(401, message)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse a body larger than `max_bytes` with 413 before it is read: by its Content-Length at once, or
    (a chunked body, whose size nobody knows in advance) as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(400, f"bad Content-Length header: {length!r}")(scope, receive, send)
            if int(length) > self.max_bytes:
                return await self._too_large(int(length), scope, receive, send)
        seen, limit = 0, self.max_bytes

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise APIError(413, f"the request body is larger than the limit of {limit} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _too_large(self, length: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is {length} bytes, larger than the limit of {self.max_bytes} bytes"
        await error_response(413, message, headers={"Connection": "close"})(scope, receive, send)


class CheckedJSONRequest(Request):
    """A Request whose `.json()` is `parse_json_body`: what FastAPI calls to read a route's JSON body."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(parse_json_body, body) if len(body) > BIG_BODY else \
                parse_json_body(body)  # fmt: skip
        return self._json


class CheckedJSONRoute(APIRoute):
    """FastAPI's route, reading the body with `CheckedJSONRequest` (FastAPI's documented way to change it)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(CheckedJSONRequest(request.scope, request.receive))

        return checked


def parse_json_body(body: bytes):
    """Strict JSON, not nested deeper than MAX_JSON_DEPTH, without lone surrogates; else APIError(400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 text: {e}") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, f"the request body's JSON is nested too deeply (the limit is {MAX_JSON_DEPTH})") from None
    check_json_value(value)
    return value


def _refuse_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def check_json_value(value) -> None:
    """Walk the parsed body without recursion: depth at most MAX_JSON_DEPTH, every string and key UTF-8-able."""
    stack, where = [(value, 1, "")], ""
    while stack:
        v, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body's JSON is nested too deeply (the limit is {MAX_JSON_DEPTH})")
        if isinstance(v, str):
            _check_text(v, where or "the body")
        elif isinstance(v, dict):
            for k, item in v.items():
                _check_text(k, f"a field name in {where or 'the body'}")
                stack.append((item, depth + 1, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(v) if not _is_leaf(item))


def _is_leaf(v) -> bool:
    return v is None or isinstance(v, (int, float))  # (bool is an int)


def _check_text(s: str, where: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            param = where.split(".")[0].split("[")[0] if not where.startswith(("the ", "a ")) else None
            raise APIError(400, f"{where}: lone UTF-16 surrogate {s[e.start]!r} at character {e.start} (a "
                                "\\ud800-\\udfff escape must be half of a pair)", param=param) from None  # fmt: skip
