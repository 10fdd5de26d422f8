"""One error envelope for every failure: ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's; routes under /v1/messages answer in Anthropic's, ``anthropic_error_body``). Every
surface's envelope lives here, so the shared core never imports a surface (docs/design.md).

Engine errors (:class:`engine.api.EngineError` and subclasses) carry their own HTTP
status; the gateway adds its own subclasses below. FastAPI's 422 for a malformed body becomes a
400 that names the offending field, as OpenAI does.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixgate.engine.api import EngineError, InvalidRequestError, OverloadedError

logger = logging.getLogger("prefixgate.server")

REQUEST_ID_HEADER = "X-Request-Id"

ANTHROPIC_PATH = "/v1/messages"  # routes under it answer in Anthropic's envelope

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AuthenticationError(EngineError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(EngineError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(EngineError):
    status_code = 404
    error_type = "invalid_request_error"


class ModelNotFoundError(NotFoundError):
    def __init__(self, model: str, served: str):
        super().__init__(
            f"The model `{model}` does not exist; this server serves `{served}`.",
            param="model",
            code="model_not_found",
        )


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict:
    """The OpenAI error envelope as a dict (also sent as an SSE event when a stream fails)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's envelope ``{"type": "error", "error": {"type", "message"}}`` for ``status``;
    the field at fault, when known, leads the message."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def engine_error_body(exc: EngineError) -> dict:
    return error_body(exc.message, exc.error_type, exc.param, exc.code)


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def engine_error_response(request: Request, exc: EngineError) -> JSONResponse:
    """Map an engine or gateway error to its status, envelope and headers."""
    headers: dict[str, str] = {}
    if isinstance(exc, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    if exc.status_code >= 500:
        logger.error("request %s failed: %s", request_id_of(request), exc.message)
    if request.url.path.startswith(ANTHROPIC_PATH):
        body = anthropic_error_body(exc.status_code, exc.message, exc.param)
        return JSONResponse(body, status_code=exc.status_code, headers=headers)
    return JSONResponse(engine_error_body(exc), status_code=exc.status_code, headers=headers)


_LOC_ROOTS = ("body", "query", "path", "header")


class _Located(NamedTuple):
    """One pydantic error placed in the client's body: ``path`` spells the field as the client
    sent it; ``depth`` counts its parts; ``in_union`` says a union member's label was left out."""

    path: str
    depth: int
    in_union: bool


def _locate(loc: tuple[Any, ...], body: Any, kind: str) -> _Located:
    """``("body", "messages", 0, "content", "list[...]", 0, "text", "text")`` → ``messages[0]
    .content[0].text``: only the keys and indexes found in ``body`` are kept. Pydantic's loc
    also names a union's members (``constrained-str``, ``list[...]``) and a tagged union's tags,
    which name no part of the body; kept, they made the 400 name a field that does not exist.
    ``body`` None (unknown) keeps every part."""
    parts = loc[1:] if loc and loc[0] in _LOC_ROOTS else loc
    path, value, depth, in_union = "", body, 0, False
    for index, part in enumerate(parts):
        missing = kind == "missing" and index == len(parts) - 1 and isinstance(value, dict)
        if body is None or isinstance(part, int) or missing or (
                isinstance(value, dict) and part in value):
            path += f"[{part}]" if isinstance(part, int) else ("." if path else "") + str(part)
            depth += 1
            if isinstance(part, int):
                value = value[part] if isinstance(value, list) and 0 <= part < len(value) else None
            elif isinstance(value, dict):
                value = value.get(part)
        else:
            in_union = True
    return _Located(path, depth, in_union)


def _is_mismatch(kind: str) -> bool:
    # what a union member says when the value is not its kind at all (the wrong branch)
    return kind.endswith("_type") or kind == "literal_error"


def _pick(errors: list[Any], body: Any) -> tuple[Any, _Located, int]:
    """The error to report, where it is, and how many errors lie elsewhere. The first error
    leads, except inside a union: pydantic reports every member's failure, the branches the
    value does not take among them ("Input should be a valid string" for a list of blocks);
    there the deepest error under the union wins, then one that is not a type mismatch."""
    located = [_locate(tuple(e.get("loc", ())), body, e.get("type", "")) for e in errors]
    if not located[0].in_union:
        return errors[0], located[0], len(errors) - 1
    root = located[0].path
    group = [i for i, where in enumerate(located) if where.in_union and (
        where.path == root or where.path.startswith((root + ".", root + "[")) or not root)]
    best = max(group, key=lambda i: (located[i].depth,
                                     not _is_mismatch(errors[i].get("type", "")), -i))
    return errors[best], located[best], len(errors) - len(group)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """Turn pydantic's error list into one InvalidRequestError naming the first bad field."""
    errors = list(exc.errors())
    if not errors:
        return InvalidRequestError("Invalid request body.")
    if errors[0].get("type", "") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return InvalidRequestError(f"Malformed JSON body: {detail}.", code="invalid_json")
    first, where, more = _pick(errors, exc.body)
    kind = first.get("type", "")
    param = where.path
    inner = (first.get("ctx") or {}).get("param")  # a path found inside the value (fields.py)
    if inner:
        param = f"{param}{'' if not param or inner.startswith('[') else '.'}{inner}"
    if not param:
        if kind == "missing":
            return InvalidRequestError("The request body is missing; send a JSON object.")
        if kind in ("model_attributes_type", "model_type", "dict_type"):
            return InvalidRequestError(
                "The request body must be a JSON object sent with Content-Type: application/json.",
                code="invalid_body",
            )
        return InvalidRequestError(f"Invalid request body: {first.get('msg')}.")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "missing":
        text = f"Missing required parameter: '{param}'."
    elif kind == "extra_forbidden":
        text = f"Unrecognized request argument: '{param}'."
    else:
        text = f"Invalid value for '{param}': {message}"
    if more:
        text += f" ({more} more error{'s' if more > 1 else ''})"
    return InvalidRequestError(text, param=param, code="invalid_value")


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI envelope."""

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return engine_error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown endpoint {request.method} {request.url.path}."
        if request.url.path.startswith(ANTHROPIC_PATH):
            return JSONResponse(anthropic_error_body(exc.status_code, message),
                                status_code=exc.status_code, headers=exc.headers)
        return JSONResponse(
            error_body(message, error_type), status_code=exc.status_code, headers=exc.headers
        )
