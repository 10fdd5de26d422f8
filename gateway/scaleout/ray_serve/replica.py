"""One prefixgate gateway inside a Ray Serve replica (a Ray actor).

The replica builds an engine and the full gateway app (every API surface, metrics, cache
stats, KV events), serves it with uvicorn on its own thread and its own asyncio loop
(``ServersThread``: the loop the suite was validated on, whatever loop Ray's actor runs), on
the node's address and a free port, and publishes KV events on the node's address. ``forward``
streams one request through that server: a ``ResponseHead`` first, then the body's bytes as
they come (SSE included), which Ray passes back to the ingress as a streaming response.

Why a local HTTP hop instead of calling the ASGI app in the actor: the app then runs exactly
as ``prefixgate serve`` runs it (lifespan, limits, disconnect handling), on its own loop, and
its port doubles as the replica's address for a Prometheus scrape or a direct look.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from prefixgate.gateway.scaleout.kv_events.config import KVEventsConfig
from prefixgate.gateway.scaleout.ray_serve.forwarded import ForwardedRequest, ResponseHead
from prefixgate.gateway.scaleout.ray_serve.request_router import (
    ROUTING_STATS_BLOCK_SIZE,
    ROUTING_STATS_EVENTS,
    ROUTING_STATS_REPLAY,
)

logger = logging.getLogger("prefixgate.ray_serve")

# headers the local hop sets itself
_NOT_FORWARDED = frozenset({"host", "content-length", "connection", "keep-alive",
                            "transfer-encoding", "te", "trailer", "upgrade"})
_NOT_RETURNED = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding",
                           "date", "server"})


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How each replica builds its engine (``EngineConfig`` keywords) and serves."""

    engine: dict[str, Any] = field(default_factory=dict)  # e.g. {"num_pages": 128}
    torch_threads: int = 1
    served_model_name: str | None = None
    log_level: str = "warning"


class PrefixgateReplica:
    """A Ray Serve deployment class: one gateway per replica (see the module docstring)."""

    def __init__(self, options: ReplicaOptions):
        import ray
        import torch
        from ray import serve

        from prefixgate.engine.async_engine import build_engine
        from prefixgate.engine.config import EngineConfig
        from prefixgate.gateway.server import ServerSettings, create_app
        from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config

        torch.set_num_threads(options.torch_threads)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        host = ray.util.get_node_ip_address()
        engine = build_engine(EngineConfig(**options.engine))
        engine.warm_grammars()
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=f"tcp://{host}:*", replay_endpoint=f"tcp://{host}:*")
        settings = ServerSettings(host=host, port=0, log_level=options.log_level,
                                  served_model_name=options.served_model_name,
                                  replica_id=self.replica_id, kv_events=events)
        app = create_app(engine, settings, manage_engine=False)
        self.server = GatewayServer(uvicorn_config(app, settings), engine, settings)
        self.thread = ServersThread([self.server], [engine], name=f"prefixgate-{self.replica_id}")
        self.thread.start_and_wait()
        self.url = self.server.base_url
        self.kv_events = app.state.kv_events
        self.block_size = engine.page_size
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
        logger.info("replica %s serving at %s, KV events on %s", self.replica_id, self.url,
                    self.kv_events.endpoint)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """Stream ``request`` through this replica's gateway: a ``ResponseHead``, then bytes."""
        url = self.url + request.path + (f"?{request.query}" if request.query else "")
        headers = [(k, v) for k, v in request.headers if k.lower() not in _NOT_FORWARDED]
        async with self.client.stream(request.method, url, headers=headers,
                                      content=request.body) as response:
            yield ResponseHead(response.status_code,
                               tuple((k, v) for k, v in response.headers.multi_items()
                                     if k.lower() not in _NOT_RETURNED),
                               self.replica_id)
            async for chunk in response.aiter_raw():
                if chunk:
                    yield chunk

    def record_routing_stats(self) -> dict[str, Any]:
        """What Ray passes to the request routers: where this replica's KV events are."""
        return {ROUTING_STATS_EVENTS: self.kv_events.endpoint,
                ROUTING_STATS_REPLAY: self.kv_events.replay_endpoint,
                ROUTING_STATS_BLOCK_SIZE: self.block_size, "url": self.url}

    def info(self) -> dict[str, Any]:
        """The replica's id, gateway URL and KV-events endpoints (tests, the recipe)."""
        return {"replica_id": self.replica_id, **self.record_routing_stats()}

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        thread = getattr(self, "thread", None)
        if thread is not None:
            self.thread = None
            thread.stop(30)
