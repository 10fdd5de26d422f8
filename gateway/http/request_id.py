"""Request ids and the last line of defence: every response carries ``X-Request-Id``, and an
unhandled exception becomes a logged 500 in the OpenAI envelope (never a bare traceback page).

A pure ASGI middleware (not ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixgate.gateway.http.errors import REQUEST_ID_HEADER, error_body

logger = logging.getLogger("prefixgate.server")

# A client may send its own id (to correlate logs); anything odd is replaced, not echoed.
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


class RequestIdMiddleware:
    """Assign ``scope["state"]["request_id"]``, echo it as a header, turn crashes into 500s."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.lower().encode(), b"")
        supplied_text = supplied.decode("latin-1")
        own = new_request_id()
        request_id = supplied_text if _CLIENT_ID_RE.match(supplied_text) else own
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        # The engine needs ids unique among live requests; a client may reuse its own id.
        state["engine_request_id"] = own if request_id == own else f"{request_id}.{own[4:12]}"
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", ()) if h[0] != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s: internal error", request_id)
            if started:
                # Headers are gone: the client sees a truncated body; nothing more to send.
                return
            body = json.dumps(
                error_body(
                    f"Internal server error (request id {request_id}); the server log has details.",
                    "internal_error",
                )
            ).encode()
            await send_with_id(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send_with_id({"type": "http.response.body", "body": body})
