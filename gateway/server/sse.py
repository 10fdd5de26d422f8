"""Server-sent events framing (``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``, or named
``event: <kind>`` events).

:class:`SSEResponse` guarantees its body generator is closed however the response ends
(finished, client gone, server shutting down), so the generator's ``finally`` can abort the
engine request and free its pages. Starlette alone only cancels the send loop on disconnect,
which can leave a generator parked at ``yield`` until garbage collection.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> bytes:
    """Frame one JSON payload as an SSE ``data:`` event."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude=exclude)
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def sse_named_event(kind: str, data: str) -> bytes:
    """Frame one serialized payload as a named event (``event: <kind>``; Responses, Messages)."""
    return f"event: {kind}\ndata: {data}\n\n".encode()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its body iterator."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None):
        # no-cache: proxies must not buffer or replay a stream; X-Accel-Buffering: nginx likewise.
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        # NOTE: closing a body generator that never started runs none of its ``finally``
        # (a client gone before the first byte): ``on_close`` releases what it holds anyway.
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                # Shielded: we may be here because our task was cancelled; cleanup must still run.
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                with anyio.CancelScope(shield=True):
                    await self.on_close()
