"""A client that leaves before a whole (non-streamed) response is ready: the work is cancelled
and :class:`ClientDisconnected` raised (the route answers 499)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.requests import Request


class ClientDisconnected(Exception):
    """The HTTP client went away before a non-streaming response was ready."""


async def until_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` (a coroutine) unless the client disconnects first; then cancel it and raise
    :class:`ClientDisconnected` (cancelling ``work`` closes its streams, which aborts them)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this route is itself cancelled (shutdown): never leave `work` running.
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
