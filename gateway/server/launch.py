"""Run the gateway under uvicorn: build the engine (loads the model), serve, log one ready line."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn

from prefixgate.engine.api import EngineLike
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kernel_report import engine_kernel_report
from prefixgate.gateway.http.bound_server import EVENT_LOOP, BoundServer
from prefixgate.gateway.http.slow_clients import uvicorn_options
from prefixgate.gateway.server.app import create_app
from prefixgate.gateway.server.settings import ServerSettings

logger = logging.getLogger("prefixgate.server")

class ServersThread(threading.Thread):
    """uvicorn servers (and the engines they use) on one event loop in a daemon thread: for
    embedding a gateway or router in another program (benchmarks, tests, notebooks).

    Args:
        servers: uvicorn servers (``serve()``, ``started``, ``should_exit``).
        engines: objects with ``async start()`` / ``async shutdown()``, run around the servers.
    """

    def __init__(self, servers: Sequence[Any], engines: Sequence[Any] = (), name: str = "servers"):
        super().__init__(name=name, daemon=True)
        self.servers = list(servers)
        self.engines = list(engines)
        self.error: BaseException | None = None

    def run(self) -> None:
        async def main() -> None:
            for engine in self.engines:
                await engine.start()
            try:
                await asyncio.gather(*(s.serve() for s in self.servers))
            finally:
                for engine in self.engines:
                    await engine.shutdown()

        try:
            asyncio.run(main())
        except BaseException as exc:  # raised again by start_and_wait() / stop()
            self.error = exc

    def start_and_wait(self, timeout_s: float = 120.0) -> None:
        """Start the thread; return once every server accepts connections.

        Raises:
            RuntimeError: the thread died first (its error chained) or the timeout passed.
        """
        self.start()
        deadline = time.monotonic() + timeout_s
        while not all(s.started for s in self.servers):
            if self.error is not None or not self.is_alive():
                raise RuntimeError(f"{self.name} failed to start: {self.error!r}") from self.error
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s} s waiting for {self.name} to start")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask every server to exit, wait for the thread, and raise what it died of, if anything."""
        for server in self.servers:
            server.should_exit = True
        self.join(timeout_s)
        if self.error is not None:
            raise self.error


class GatewayServer(BoundServer):
    """A uvicorn server that logs where it listens once the socket is bound and the app started."""

    def __init__(self, config: uvicorn.Config, engine: EngineLike, settings: ServerSettings):
        super().__init__(config)
        self.engine = engine
        self.settings = settings

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        cache = self.engine.cache_stats()
        engine = self.engine.engine_stats()
        logger.info(
            "prefixgate ready: %s at %s/v1 (auth %s; %d KV pages x %d tokens; %s on %s, %s, KV %s)",
            self.config.app.state.server.model_name,
            self.base_url,
            "on" if self.settings.auth_enabled else "off",
            cache.num_pages,
            cache.page_size,
            engine.kernel_backend,
            engine.device,
            engine.dtype,
            engine.kv_dtype,
        )
        kernels = engine_kernel_report(self.engine)
        if kernels is not None and kernels.degraded:
            # NOTE: the library's own warning scrolled by during the model load; this is the
            # last thing a user reads before sending requests
            logger.warning("native CPU kernels not in use: %s; serving on %s (several times "
                           "slower; /v1/models reports it)", kernels.fallback_reason,
                           kernels.backend)


def uvicorn_config(app: Any, settings: ServerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        loop=EVENT_LOOP,
        # Streams end when the engine stops; do not wait minutes for slow clients on shutdown.
        timeout_graceful_shutdown=5,
        access_log=settings.log_level == "debug",
        **uvicorn_options(settings.limits),
    )


def serve(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Load the model, then serve until interrupted (the app starts and stops the engine)."""
    from prefixgate.engine.async_engine import build_engine  # heavy: torch, the model

    engine = build_engine(engine_config, tier_store=tier_store(engine_config, settings))
    engine.warm_grammars()
    app = create_app(engine, settings)
    GatewayServer(uvicorn_config(app, settings), engine, settings).run()


def tier_store(engine_config: EngineConfig, settings: ServerSettings) -> Any:
    """The fleet's Redis tier for ``--kv-tier redis`` (the host tier is built by the engine)."""
    if engine_config.kv_tier != "redis":
        return None
    if not settings.redis_url:
        raise SystemExit("--kv-tier redis needs --redis-url")
    if not settings.kv_tier_secret:
        raise SystemExit("--kv-tier redis needs --kv-tier-secret (or PREFIXGATE_KV_TIER_SECRET): "
                         "the fleet secret that authenticates tier entries, the same on every "
                         "replica")
    from prefixgate.gateway.scaleout.kv_tier_redis import RedisTier

    try:
        return RedisTier(settings.redis_url, int(engine_config.kv_tier_size_gb * (1 << 30)),
                         secret=settings.kv_tier_secret)
    except ValueError as exc:
        raise SystemExit(f"--kv-tier redis: {exc}") from exc
