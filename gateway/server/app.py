"""The FastAPI application: :func:`create_app` wires an engine and settings into routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from prefixgate.engine.api import EngineLike
from prefixgate.gateway.http import dashboard
from prefixgate.gateway.http.api_keys import DEFAULT_TENANT
from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.http.errors import REQUEST_ID_HEADER, install_exception_handlers
from prefixgate.gateway.http.request_id import RequestIdMiddleware
from prefixgate.gateway.http.slow_clients import BodyLimitMiddleware, prompt_body_caps
from prefixgate.gateway.server import routes_cache, routes_ops
from prefixgate.gateway.server.anthropic import routes as anthropic_routes
from prefixgate.gateway.server.metrics import GatewayMetrics
from prefixgate.gateway.server.openai import routes as openai_routes
from prefixgate.gateway.server.responses import routes as responses_routes
from prefixgate.gateway.server.responses.store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from prefixgate.gateway.server.settings import ServerSettings
from prefixgate.gateway.server.state import ServerState
from prefixgate.gateway.server.tokenization import Tokenization

logger = logging.getLogger("prefixgate.server")


def create_app(
    engine: EngineLike, settings: ServerSettings | None = None, *, manage_engine: bool = True
) -> FastAPI:
    """Build the gateway app around an engine.

    Args:
        engine: anything implementing :class:`engine.api.EngineLike`.
        settings: HTTP settings; defaults to an open server (no auth, no CORS).
        manage_engine: start the engine when the app starts and shut it down when it stops.
            Pass False when another app (or the caller) owns the engine's lifecycle.

    Returns:
        The app; its serving objects are on ``app.state.server`` (a :class:`ServerState`).
    """
    settings = settings or ServerSettings()
    state = _server_state(engine, settings)
    # Scale-out: built now so a bad --replica-id / --advertise-url fails before serving.
    publisher = None
    if settings.redis_url:
        from prefixgate.gateway.scaleout.publisher import publisher_from_settings

        publisher = publisher_from_settings(engine, settings, state.model_name,
                                            clients=state.clients.snapshot)
    kv_events = None
    if settings.kv_events is not None and settings.kv_events.enabled:
        from prefixgate.gateway.scaleout.kv_events.metrics import KVEventsCollector
        from prefixgate.gateway.scaleout.kv_events.publisher import (
            publisher_from_settings as kv_events_publisher,
        )

        kv_events = kv_events_publisher(engine, settings.kv_events, state.model_name,
                                        DEFAULT_TENANT)
        state.metrics.registry.register(KVEventsCollector(kv_events.status, state.model_name))
    app = FastAPI(
        title="prefixgate",
        description="Prefix-caching OpenAI-compatible gateway",
        lifespan=_lifespan(state, publisher, manage_engine, kv_events),
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.server = state
    app.state.publisher = publisher  # None unless --redis-url
    app.state.kv_events = kv_events  # None unless --kv-events-config enables them
    app.state.responses = _response_store(settings)
    app.state.keys = state.keys  # read by the auth dependencies
    install_exception_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    _add_middleware(app, settings, prompt_body_caps(
        state.capacity, getattr(engine.tokenizer, "max_token_bytes", None)))
    return app


# every surface's router, then the cache, operations and dashboard routes
ROUTERS = (openai_routes.router, anthropic_routes.router, responses_routes.router,
           routes_cache.router, routes_ops.router, dashboard.router)


def _server_state(engine: EngineLike, settings: ServerSettings) -> ServerState:
    model_name = settings.served_model_name or engine.model_name
    pool = engine.cache_stats()  # once, before serving: pool geometry never changes
    capacity = min(engine.max_model_len, pool.num_pages * pool.page_size)
    return ServerState(
        engine=engine,
        settings=settings,
        model_name=model_name,
        keys=KeyTable.from_settings(settings),
        metrics=GatewayMetrics(engine, model_name, settings.max_agent_labels),
        tokenization=Tokenization(engine, capacity, settings.tool_call_format),
        capacity=capacity,
        page_size=pool.page_size,
    )


def _lifespan(state: ServerState, publisher: Any, manage_engine: bool, kv_events: Any = None
              ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start the engine (when the app owns it) and the publishers; stop them in reverse."""
    engine = state.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start()
        if kv_events is not None:
            kv_events.attach(engine)  # before any request: its first batch is a snapshot
            kv_events.start()
        if publisher is not None:
            await publisher.start()
        try:
            yield
        finally:
            if publisher is not None:
                await publisher.stop()
            if kv_events is not None:
                kv_events.stop()
            if manage_engine:
                await engine.shutdown()
            state.tokenization.close()

    return lifespan


def _response_store(settings: ServerSettings) -> ResponseStore:
    """Responses API state: in Redis when the fleet has one (any replica continues a
    conversation), else in this process."""
    if settings.redis_url:
        from prefixgate.gateway.scaleout.redis_client import connect

        return RedisResponseStore(connect(settings.redis_url), ttl_s=settings.response_ttl_s)
    return MemoryResponseStore(settings.max_stored_responses, ttl_s=settings.response_ttl_s)


def _add_middleware(app: FastAPI, settings: ServerSettings,
                    route_caps: dict[str, tuple[int, str]]) -> None:
    # Inside CORS and the request id, so a 413/408 carries both.
    app.add_middleware(BodyLimitMiddleware, limits=settings.limits, route_caps=route_caps)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Agent-Id", REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER],
        )
    # Added last = outermost: every response, errors included, carries X-Request-Id.
    app.add_middleware(RequestIdMiddleware)
