"""Run the router under uvicorn (``prefixgate route``)."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from prefixgate.gateway.http.bound_server import EVENT_LOOP, BoundServer
from prefixgate.gateway.http.slow_clients import uvicorn_options
from prefixgate.gateway.router.app import create_router_app
from prefixgate.gateway.router.settings import RouterSettings

logger = logging.getLogger("prefixgate.router")


class RouterServer(BoundServer):
    """A uvicorn server that logs one ready line once bound."""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        state = self.config.app.state.router
        logger.info("prefixgate router ready at %s/v1: %d replicas, policy %s, index %s",
                    self.base_url, len(state.fleet.replicas), state.policy.name,
                    state.settings.redis_url or "off (own view only)")


def router_server(settings: RouterSettings, app: Any = None) -> RouterServer:
    app = app if app is not None else create_router_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, lifespan="on", loop=EVENT_LOOP,
                            timeout_graceful_shutdown=5,
                            access_log=settings.log_level == "debug",
                            **uvicorn_options(settings.limits))
    return RouterServer(config)


def serve_router(settings: RouterSettings) -> None:
    """Load the tokenizer, then route until interrupted."""
    router_server(settings).run()
