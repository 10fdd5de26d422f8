"""Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

PATH_PREFIX = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """The envelope for ``status``; the field at fault, when known, leads the message."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}
