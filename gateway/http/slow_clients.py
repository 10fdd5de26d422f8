"""Enforcing :class:`gateway.http.limits.ConnectionLimits`: header and body read deadlines, a
connection cap, a body-size cap.

uvicorn alone leaves three holes: a connection that never finishes its headers is never
closed (its keep-alive timer arms only after a response), nothing bounds a request body's size
or how long it takes to arrive, and its ``limit_concurrency`` answers a bare-text 503. Two
pieces close them, shared by ``prefixgate serve`` and ``prefixgate route``:

* :class:`GuardedH11Protocol` (uvicorn's h11 protocol, one timer added): a connection must
  deliver a request's complete headers within ``header_timeout_s`` of opening (or of the first
  byte of its next request on a kept-alive connection), else it is closed, with a 408 when it
  had sent part of a request. It also enforces ``max_connections``: a request arriving while
  more connections are open (or requests in flight) gets a 503 in the error envelope. The
  header size is bounded by h11's ``max_incomplete_event_size`` (``max_header_bytes``).
* :class:`BodyLimitMiddleware` (pure ASGI): a declared ``Content-Length`` over
  ``max_body_bytes`` gets a 413 before a byte of the body is read (no ``100 Continue``); a
  chunked body is counted as it arrives; the whole body must arrive within ``body_timeout_s``
  of its headers, else 408. The body is read before the route runs (the routes parse it whole
  anyway), so nothing here touches a response: SSE streams are never cut.

Why a protocol subclass for headers: the app only sees a request once its headers are
complete, so no ASGI middleware can time a half-sent request line; the timer has to live where
the bytes arrive. The subclass overrides three hooks and calls uvicorn's code for the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixgate.gateway.http.errors import ANTHROPIC_PATH, anthropic_error_body, error_body
from prefixgate.gateway.http.limits import ConnectionLimits

logger = logging.getLogger("prefixgate.server")


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that apply ``limits``."""
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": limits.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "backlog": limits.backlog,
        "limit_concurrency": None,  # enforced by GuardedH11Protocol, with the error envelope
    }


def error_message(path: str, status: int, message: str, code: str) -> tuple[list, bytes]:
    """Headers and JSON body of an error in the route's envelope (Anthropic's under /v1/messages);
    ``Connection: close`` because the rest of the request will not be read."""
    if path.startswith(ANTHROPIC_PATH):
        body = anthropic_error_body(status, message)
    else:
        kind = "invalid_request_error" if status < 500 else "server_overloaded"
        body = error_body(message, kind, None, code)
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),
    ]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return headers, data


async def send_error(scope: Scope, send: Send, status: int, message: str, code: str) -> None:
    headers, data = error_message(scope.get("path", ""), status, message, code)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# bytes of JSON one byte of prompt text can take at most (a control character as \u0000)
JSON_ESCAPE_BYTES = 6
# what a one-prompt body carries beside its prompt text: JSON structure, a response format's
# schema, metadata, sampling fields (each bounded in fields.py far below this)
NON_PROMPT_BYTES = 4 * 1024 * 1024
# the routes whose body renders into ONE prompt (a chat's n choices share it); completions
# take up to MAX_PROMPTS prompts, so they keep --max-body-size
ONE_PROMPT_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages",
                     "/v1/messages/count_tokens", "/tokenize")


def prompt_body_caps(capacity: int, max_token_bytes: int | None) -> dict[str, tuple[int, str]]:
    """Per-route body caps from the context: a one-prompt body larger than its prompt could be
    (``capacity`` tokens of at most ``max_token_bytes`` UTF-8 bytes each, every byte
    JSON-escaped) plus its other fields can never succeed, so it is refused by its
    Content-Length before it is read or parsed (a flood of maximal bodies then costs the
    server no JSON parsing). None = the tokenizer has no provable byte bound: no caps."""
    if not max_token_bytes:
        return {}
    cap = capacity * max_token_bytes * JSON_ESCAPE_BYTES + NON_PROMPT_BYTES
    why = (f"a prompt that fits the context ({capacity} tokens of at most {max_token_bytes} "
           "bytes each) and the request's other fields never need more")
    return {route: (cap, why) for route in ONE_PROMPT_ROUTES}


class BodyLimitMiddleware:
    """Read the request body under a size cap and a deadline, then hand it to the app."""

    def __init__(self, app: ASGIApp, limits: ConnectionLimits,
                 route_caps: Mapping[str, tuple[int, str]] | None = None):
        """``route_caps``: path -> (a tighter cap, why), for routes whose body can be bounded
        by what can succeed there (:func:`prompt_body_caps`)."""
        self.app = app
        self.limits = limits
        self.route_caps = dict(route_caps or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limits.max_body_bytes
        too_large = f"The request body exceeds the limit of {cap} bytes (--max-body-size)."
        route_cap = self.route_caps.get(scope.get("path", ""))
        if route_cap is not None and route_cap[0] < cap:
            cap = route_cap[0]
            too_large = f"The request body exceeds the limit of {cap} bytes of this route: {route_cap[1]}."
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            await send_error(scope, send, 413, too_large, "request_too_large")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await send_error(
                    scope, send, 408,
                    f"The request body did not arrive within {self.limits.body_timeout_s:g} s "
                    "(--body-timeout).",
                    "request_timeout",
                )
                return
            if message["type"] == "http.disconnect":
                return  # the client left mid-body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await send_error(scope, send, 413, too_large, "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            # The body once, then the real channel: the app still hears http.disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header-read deadline and a connection cap with an envelope.

    Use :func:`guarded_protocol` to get the class for given limits.
    """

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._inner_app = self.app
        self.app = self._admit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        # NOTE: their_state is IDLE exactly while no request's headers are complete (before the
        # first, or after start_next_cycle). The deadline runs from the first moment, not the
        # last byte: a client trickling a byte a second gains nothing.
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(
                    self.limits.header_timeout_s, self._header_timeout
                )
        else:
            self._cancel_header_timer()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:  # part of a request came: say why; a silent idle socket just closes
            headers, data = error_message(
                "", 408,
                f"The request headers did not arrive within {self.limits.header_timeout_s:g} s "
                "(--header-timeout).",
                "request_timeout",
            )
            head = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(
                name + b": " + value + b"\r\n" for name, value in headers
            )
            self.transport.write(head + b"\r\n" + data)
        self.transport.close()

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Both sets already hold this connection and this request's task.
        cap = self.limits.max_connections
        if cap and (len(self.connections) > cap or len(self.tasks) > cap):
            logger.warning("over --max-connections %d: answered 503", cap)
            await send_error(
                scope, send, 503,
                f"The server is at its limit of {cap} concurrent connections; retry shortly.",
                "too_many_connections",
            )
            return
        await self._inner_app(scope, receive, send)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass bound to ``limits`` (uvicorn builds one per
    connection from the class alone)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
