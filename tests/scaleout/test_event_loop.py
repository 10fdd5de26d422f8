"""The gateway's and the router's uvicorn servers run on asyncio's loop even where uvloop is
installed (ray[serve] installs it): installing a package must not change the event loop the
suite was validated on (gateway/server/launch.py, EVENT_LOOP)."""

from __future__ import annotations

import asyncio

from prefixgate.gateway.http.bound_server import EVENT_LOOP
from prefixgate.gateway.router.launch import router_server
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.server.launch import uvicorn_config
from prefixgate.gateway.server.settings import ServerSettings


def _loop_class(config) -> type:
    loop = config.get_loop_factory()()
    try:
        return type(loop)
    finally:
        loop.close()


def test_gateway_and_router_pin_asyncio_loop():
    assert EVENT_LOOP == "asyncio"
    gateway = uvicorn_config(object(), ServerSettings(port=0))
    router = router_server(RouterSettings(replicas=("http://127.0.0.1:1",), port=0),
                           app=object()).config
    for config in (gateway, router):
        assert config.loop == "asyncio"
        loop_class = _loop_class(config)
        assert issubclass(loop_class, asyncio.AbstractEventLoop)
        assert "uvloop" not in loop_class.__module__, loop_class
