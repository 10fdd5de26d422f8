"""Operational endpoints: liveness (always open) and Prometheus metrics (with auth on, the admin
key, unless ``--metrics-public on``: the series carry every tenant and agent label)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from prefixgate.gateway.http.auth import require_admin
from prefixgate.gateway.http.metric_labels import CONTENT_TYPE
from prefixgate.gateway.server.state import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, object]:
    state = server_state(request)
    engine = await state.engine_stats()
    return {
        "status": "ok",
        "model": state.model_name,
        "num_running": engine.num_running,
        "num_waiting": engine.num_waiting,
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    if not state.settings.metrics_public:
        await require_admin(request)  # 401/403 in the error envelope; open when auth is off
    # Collecting reads the engine's snapshots (its lock): on a worker thread.
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
