"""Agent-aware retention from the HTTP side: a response that ends in tool calls keeps its
conversation's pages ahead of LRU eviction for a TTL, because the agent comes back with the
tool's result and resends that whole prefix (cache/retention.py has the soft eviction order).

The TTL: the request's hint (``retention_seconds`` in the body, or the ``X-Retention-Seconds``
header; Anthropic's ``cache_control.ttl``), else the server's ``--retention`` (default 30 s).
Retention runs in the background after the response: it never delays or fails a response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from starlette.requests import Request

from prefixgate.gateway.engine.api import InvalidRequestError
from prefixgate.gateway.server.state import server_state

logger = logging.getLogger("prefixgate.server")

RETENTION_HEADER = "X-Retention-Seconds"
MAX_RETENTION_S = 3600.0
_background: set[asyncio.Task[None]] = set()


def retention_ttl(request: Request, hint: float | None) -> float:
    """The TTL for this request's tool pause: header, else body hint, else the server default."""
    header = request.headers.get(RETENTION_HEADER)
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise InvalidRequestError(f"{RETENTION_HEADER} must be a number of seconds",
                                      param=RETENTION_HEADER) from None
        if not 0 <= value <= MAX_RETENTION_S:
            raise InvalidRequestError(f"{RETENTION_HEADER} must be in [0, {MAX_RETENTION_S:g}]",
                                      param=RETENTION_HEADER)
        return value
    if hint is not None:
        return hint
    return server_state(request).settings.retention_s


def retain_later(request: Request, tenant: str, cache_salt: str | None,
                 token_ids: Sequence[int], ttl_s: float) -> None:
    """Retain ``token_ids``'s cached full blocks for ``ttl_s`` once the engine lock is free."""
    if ttl_s <= 0 or not token_ids:
        return
    engine = server_state(request).engine

    async def run() -> None:
        try:
            await engine.retain(list(token_ids), tenant, cache_salt, ttl_s)
        except Exception:  # noqa: BLE001 - retention is an optimisation, never a failure
            logger.exception("retention of %d tokens failed", len(token_ids))

    task = asyncio.get_running_loop().create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)
