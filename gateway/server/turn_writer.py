"""Serving one opened turn, for every API surface: the one SSE loop and the one whole-response
path. A surface supplies a :class:`TurnWriter` (its stream events, its error event, its whole
response); everything else (closing the engine streams however the response ends, mid-stream
errors after the first byte, a client gone before a whole response) is decided here once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from prefixgate.engine.api import EngineError
from prefixgate.gateway.http.disconnect import ClientDisconnected
from prefixgate.gateway.http.errors import request_id_of
from prefixgate.gateway.server.sse import SSEResponse
from prefixgate.gateway.server.turn_stream import ChoiceDelta, TurnEnd, TurnStream

logger = logging.getLogger("prefixgate.server")

# 499 (nginx's "client closed request"): logged, never seen by the client, who is gone.
CLIENT_CLOSED_REQUEST = 499


class TurnWriter:
    """How one API surface writes a turn. ``log_id`` names the response in logs."""

    log_id = "request"

    def start(self) -> list[bytes]:
        """The events before the first delta (a role chunk, ``message_start``, ...)."""
        return []

    def delta(self, delta: ChoiceDelta) -> list[bytes]:
        raise NotImplementedError

    async def end(self, end: TurnEnd) -> list[bytes]:
        """The closing events (usage, finish, ``[DONE]``)."""
        raise NotImplementedError

    def error(self, exc: EngineError | None) -> list[bytes]:
        """The error event(s) after the first byte (None: an internal error, logged here)."""
        raise NotImplementedError

    async def whole(self, end: TurnEnd) -> Any:
        """The non-streaming response body."""
        raise NotImplementedError


async def stream_turn(turn: TurnStream, writer: TurnWriter) -> AsyncIterator[bytes]:
    """The SSE body of a streamed turn. Errors after the first byte cannot change the status
    code: the surface's error event is sent instead, as vLLM and OpenAI do."""
    try:
        for chunk in writer.start():
            yield chunk
        async for item in turn.deltas():
            chunks = await writer.end(item) if isinstance(item, TurnEnd) else writer.delta(item)
            for chunk in chunks:
                yield chunk
    except EngineError as exc:
        logger.warning("%s failed mid-stream: %s", writer.log_id, exc.message)
        for chunk in writer.error(exc):
            yield chunk
    except Exception:
        logger.exception("%s: internal error mid-stream", writer.log_id)
        for chunk in writer.error(None):
            yield chunk
    finally:
        await turn.aclose()


async def respond(request: Request, turn: TurnStream, writer: TurnWriter, stream: bool,
                  headers: dict[str, str] | None = None) -> Any:
    """Stream the turn as SSE, or collect it into the surface's whole response (giving up, and
    aborting, if the client disconnects first)."""
    if stream:
        return SSEResponse(stream_turn(turn, writer), headers, on_close=turn.aclose)
    try:
        end = await turn.collect(request)
    except ClientDisconnected:
        logger.info("request %s: client disconnected before the response", request_id_of(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return await writer.whole(end)
