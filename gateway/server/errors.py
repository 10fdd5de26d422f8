"""One error envelope for every failure: ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's; routes under /v1/messages answer in Anthropic's, ``anthropic_error_body``). Every
surface's envelope lives here, so the shared core never imports a surface (docs/design.md).

Engine errors (:class:`gateway.engine.api.EngineError` and subclasses) carry their own HTTP
status; the gateway adds its own subclasses below. FastAPI's 422 for a malformed body becomes a
400 that names the offending field, as OpenAI does.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixgate.gateway.engine.api import EngineError, InvalidRequestError, OverloadedError

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


def _param_path(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` → ``messages[0].role``."""
    path = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """Turn pydantic's error list into one InvalidRequestError naming the first bad field."""
    errors = list(exc.errors())
    if not errors:
        return InvalidRequestError("Invalid request body.")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return InvalidRequestError(f"Malformed JSON body: {detail}.", code="invalid_json")
    param = _param_path(tuple(first.get("loc", ())))
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
    if len(errors) > 1:
        text += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
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
