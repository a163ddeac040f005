"""Every error the server answers, in OpenAI's shape, whoever raised it.

    {"error": {"message": "temperature must be >= 0 (0 means greedy), got -1", "type": "BadRequestError",
               "param": "temperature", "code": 400}}

The official clients read this body to raise `openai.BadRequestError` and friends, so it must come back for
every failure, not only for the ones a route raises itself:

    raised by                                   becomes
    a route: APIError(status, message)          that status
    FastAPI: the body does not fit the model    400 (FastAPI says 422; OpenAI and vLLM say 400), naming the field
    Starlette: no such path / method            404 / 405 (with its Allow header)
    the middleware (middleware.py)              401 (API key), 413 (body too large), 400 (bad JSON)
    the request's deadline (serving_engine.py)  504, with --request-timeout
    anything else                               500, still this JSON: never a plain-text "Internal Server Error"

The JSON is written with ASCII escapes: a message that quotes the client's own text can never fail to encode.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from roseinfer.entrypoints.openai import protocol

logger = logging.getLogger("roseinfer.server")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               415: "UnsupportedMediaTypeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
               499: "ClientClosedRequest", 500: "InternalServerError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}  # fmt: skip


class APIError(HTTPException):
    """An error for the client (4xx), a refusal for now (503) or a deadline passed (504), in OpenAI's shape. An
    HTTPException, so that FastAPI passes it on unchanged even when it is raised while the body is being read."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(status, message, headers)
        self.message, self.param = message, param
        self.err_type = err_type or ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict:
        return error_body(self.status_code, self.message, self.param, self.err_type)

    def response(self) -> Response:
        return error_response(self.status_code, self.message, self.param, self.err_type, self.headers)


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    err_type = err_type or ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, err_type: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:  # fmt: skip
    body = json.dumps(error_body(status, message, param, err_type))  # ensure_ascii: a lone surrogate is escaped
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for FastAPI's validation errors: the first field at fault, in pydantic's words.

    A value that may have several types fails once per type, and pydantic puts the type's name in the error's
    location, after the field's: ("body", "prompt", "list[int]", 1). Such errors are summed up by the types
    the field accepts. A body that is itself one of several models (POST /tokenize) is judged as the model
    it fails least."""
    errors = [([str(p) for p in e.get("loc", ()) if p != "body"], e) for e in exc.errors()]
    if errors and errors[0][0] and _is_tag(errors[0][0][0]):  # the body is a union of models
        by_model: dict[str, list] = {}
        for loc, e in errors:
            by_model.setdefault(loc[0], []).append((loc[1:], e))
        errors = min(by_model.values(), key=len)
    if not errors:
        return "the request body is not valid", None
    loc, first = errors[0]
    if not loc:
        if first.get("type") == "missing":
            return "the request body is missing: send a JSON object", None
        return f"the request body must be a JSON object (Content-Type: application/json): {first['msg']}", None
    at = next((i for i, p in enumerate(loc) if i > 0 and _is_tag(p)), None)
    if at is not None:  # one field, several allowed types
        types = [lc[at] for lc, _ in errors if lc[:at] == loc[:at] and len(lc) > at and _is_tag(lc[at])]
        return f"{_path(loc[:at])}: must be {' or '.join(dict.fromkeys(types))}", loc[0]
    if first.get("type") == "missing":
        return f"{_path(loc)} is required", loc[0]
    return f"{_path(loc)}: {first['msg']}", loc[0]


def _is_tag(part: str) -> bool:
    """A type's name in a pydantic error location: 'str', 'list[int]', 'TextPart' ... (not a field name)."""
    return part in _TYPE_NAMES or "[" in part or part in _MODEL_NAMES


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
_MODEL_NAMES = {name for name, obj in vars(protocol).items() if isinstance(obj, type) and issubclass(obj, BaseModel)}


def _path(loc: list[str]) -> str:
    """["messages", "0", "role"] -> "messages[0].role"."""
    out = ""
    for p in loc:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}: see GET /openapi.json for the routes this server has"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r} (allowed: {exc.headers['Allow']})"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
