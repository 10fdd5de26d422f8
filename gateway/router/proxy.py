"""Pass-through to a replica: the request as the client sent it, the response as the replica
sent it (status, headers, and the body's raw bytes, streamed chunk by chunk).

* Streaming is preserved byte for byte: ``aiter_raw`` hands over exactly what arrived.
* A client that goes away closes the upstream response, which closes the connection: the
  replica sees the disconnect and aborts the request (frees its pages). Before the response
  starts, :func:`gateway.http.disconnect.until_disconnect` watches for it; after, Starlette cancels the body.
* If the replica dies mid-stream, an SSE stream ends with an error event and ``[DONE]``
  (when it was cut between events), as a replica itself does when its engine fails.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from prefixgate.gateway.http.errors import REQUEST_ID_HEADER, error_body

# RFC 9110 connection-specific headers, plus those the HTTP stack sets itself.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_NOT_FORWARDED_BACK = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "date", "server",
})

REPLICA_HEADER = "X-Prefixgate-Replica"
REASON_HEADER = "X-Prefixgate-Route"


def upstream_headers(headers: Iterable[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones, with our request id (the replica reuses it)."""
    out = [(k, v) for k, v in headers
           if k.lower() not in _HOP_BY_HOP and k.lower() != REQUEST_ID_HEADER.lower()]
    out.append((REQUEST_ID_HEADER, request_id))
    return out


class ProxyResponse(StreamingResponse):
    """Streams an upstream ``httpx.Response`` (opened with ``stream=True``) to the client and
    always closes it, however the response ends; ``on_close`` runs once afterwards."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None],
                 extra_headers: dict[str, str] | None = None):
        self.upstream = upstream
        self.on_close = on_close
        super().__init__(self._body(), status_code=upstream.status_code)
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in upstream.headers.multi_items()
               if k.lower() not in _NOT_FORWARDED_BACK]
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in (extra_headers or {}).items()]
        self.raw_headers = raw
        self.upstream_error: str | None = None

    @property
    def is_sse(self) -> bool:
        return self.upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def _body(self) -> AsyncIterator[bytes]:
        at_boundary = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if chunk:
                    at_boundary = chunk.endswith(b"\n\n")
                    yield chunk
        except httpx.HTTPError as exc:
            self.upstream_error = f"{type(exc).__name__}: {exc}"
            if not (self.is_sse and at_boundary):
                raise  # the client sees a cut body, which is what happened
            message = "The replica serving this stream failed mid-response; retry the request."
            payload = json.dumps(error_body(message, "upstream_error", code="replica_failed"))
            yield b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: we may be here because the client left and our task was cancelled.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.upstream.aclose()
                self.on_close()


def build_request(client: httpx.AsyncClient, method: str, url: str, headers: list[tuple[str, str]],
                  body: bytes, params: Any = None) -> httpx.Request:
    return client.build_request(method, url, headers=headers, content=body, params=params)
