"""Operational endpoints: liveness and Prometheus metrics (both open, even with auth on)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from prefixgate.gateway.server.metrics import CONTENT_TYPE
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
    # Collecting reads the engine's snapshots (its lock): on a worker thread.
    body = await asyncio.to_thread(server_state(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
