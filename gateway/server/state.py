"""The serving objects one app holds on ``app.state.server`` (engine, settings, metrics, ...)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from prefixgate.cache.stats import CacheStats
from prefixgate.engine.api import EngineLike, EngineStats, InvalidRequestError
from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.http.errors import ModelNotFoundError
from prefixgate.gateway.http.headers import AGENT_HEADER
from prefixgate.gateway.server.clients import ClientCounters, model_served
from prefixgate.gateway.server.fields import MAX_LABEL_CHARS
from prefixgate.gateway.server.metrics import GatewayMetrics
from prefixgate.gateway.server.settings import ServerSettings
from prefixgate.gateway.server.tokenization import Tokenization


@dataclass(slots=True)
class ServerState:
    engine: EngineLike
    settings: ServerSettings
    model_name: str
    keys: KeyTable
    metrics: GatewayMetrics
    tokenization: Tokenization
    # The most tokens one sequence can hold (context window and whole page pool); fixed.
    capacity: int
    page_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    clients: ClientCounters = field(default_factory=ClientCounters)

    # The engine's snapshots take its lock, which a running step holds: read them on a worker
    # thread so a slow forward pass never stalls the event loop (and every other stream).
    async def cache_stats(self) -> CacheStats:
        return await asyncio.to_thread(self.engine.cache_stats)

    async def engine_stats(self) -> EngineStats:
        return await asyncio.to_thread(self.engine.engine_stats)

    def check_model(self, model: str | None) -> None:
        """Requests may omit ``model``; a named one must be the served model or match one of
        its ``--model-alias`` globs (else 404)."""
        if model is not None and not model_served(model, self.model_name,
                                                  self.settings.model_aliases):
            raise ModelNotFoundError(model, self.model_name)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def engine_request_id(request: Request) -> str:
    """The id the engine knows this request by (unique even when a client reuses X-Request-Id)."""
    return request.state.engine_request_id


def agent_of(request: Request, user: str | None) -> str | None:
    """The agent label for stats: the ``X-Agent-Id`` header, else the body's ``user`` field."""
    header = request.headers.get(AGENT_HEADER)
    if header is None:
        return user
    header = header.strip()
    if not header or len(header) > MAX_LABEL_CHARS:
        raise InvalidRequestError(
            f"{AGENT_HEADER} must be 1-{MAX_LABEL_CHARS} characters", param=AGENT_HEADER
        )
    return header
