"""A live gateway for the tests (a pytest plugin loaded by tests/conftest.py, so every test
package shares ONE engine): the real engine (default SmolLM2 model, small page pool) served
by uvicorn on free loopback ports, in a background thread.

Two apps share the one engine (the model loads once): ``open_url`` has no auth (tenant
"default"); ``auth_url`` has tenant keys and an admin key.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, uvicorn_config

PAGE_SIZE = 16
NUM_PAGES = 384  # ~290 MB of fp32 KV for SmolLM2-135M; plenty for the 50-stream test
MAX_WAITING = 128

KEY_ALPHA = "sk-alpha"
KEY_BETA = "sk-beta"
KEY_PLAIN = "sk-plain"  # no tenant given: "default"
ADMIN_KEY = "sk-admin"
API_KEYS = {KEY_ALPHA: "alpha", KEY_BETA: "beta", KEY_PLAIN: "default"}


@dataclass(frozen=True)
class LiveGateway:
    open_url: str
    auth_url: str
    model: str
    page_size: int
    max_model_len: int


class _ServerThread(threading.Thread):
    """Runs the engine and both uvicorn servers on one event loop in a daemon thread."""

    def __init__(self, engine, servers: list[GatewayServer]):
        super().__init__(name="prefixgate-test-server", daemon=True)
        self.engine = engine
        self.servers = servers
        self.error: BaseException | None = None

    def run(self) -> None:
        async def main() -> None:
            await self.engine.start()
            try:
                await asyncio.gather(*(s.serve() for s in self.servers))
            finally:
                await self.engine.shutdown()

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by the fixture, never swallowed
            self.error = exc


def _wait_started(thread: _ServerThread, servers: list[GatewayServer]) -> None:
    deadline = time.monotonic() + 120
    while not all(s.started for s in servers):
        if thread.error is not None or not thread.is_alive():
            raise RuntimeError(f"the test server failed to start: {thread.error!r}")
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start within 120 s")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def engine(loaded_model):
    from prefixgate.engine.async_engine import build_engine

    return build_engine(
        EngineConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_waiting=MAX_WAITING),
        loaded=loaded_model,
    )


@contextlib.contextmanager
def live_servers(engine, settings_list: list[ServerSettings]) -> Iterator[list[GatewayServer]]:
    """Serve one app per settings over ``engine`` (started and stopped here) on free ports."""
    servers = []
    for settings in settings_list:
        # The fixture owns the engine's lifecycle: no app starts or stops it.
        app = create_app(engine, settings, manage_engine=False)
        servers.append(GatewayServer(uvicorn_config(app, settings), engine, settings))
    thread = _ServerThread(engine, servers)
    thread.start()
    _wait_started(thread, servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(timeout=60)
    if thread.error is not None:
        raise thread.error


@pytest.fixture(scope="session")
def gateway(engine) -> Iterator[LiveGateway]:
    open_settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning")
    auth_settings = ServerSettings(
        host="127.0.0.1", port=0, api_keys=API_KEYS, admin_key=ADMIN_KEY, log_level="warning"
    )
    with live_servers(engine, [open_settings, auth_settings]) as servers:
        yield LiveGateway(
            open_url=servers[0].base_url,
            auth_url=servers[1].base_url,
            model=servers[0].config.app.state.server.model_name,
            page_size=PAGE_SIZE,
            max_model_len=engine.max_model_len,
        )


@pytest.fixture()
def live_gateway_url(gateway: LiveGateway) -> str:
    """Base URL (no auth) of the shared live gateway, for client-side tests (agents/)."""
    return gateway.open_url


@pytest.fixture()
def client(gateway: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.open_url, timeout=120) as c:
        yield c


def wait_idle(
    client: httpx.Client, headers: dict[str, str] | None = None, timeout_s: float = 120
) -> dict:
    """Poll /v1/cache/stats until no request runs or waits and no page is referenced.

    Aborts free pages asynchronously (the engine notices between steps), hence polling; the
    deadline only bounds a failure, it never decides a pass.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get("/v1/cache/stats", headers=headers).json()
        engine = stats["engine"]
        if (
            engine["num_running"] == 0
            and engine["num_waiting"] == 0
            and stats["pages_used"] == stats["pages_pinned"]
        ):
            return stats
        if time.monotonic() > deadline:
            return stats  # the caller's assertions show what leaked
        time.sleep(0.05)


def shared_block_tokens(a: list[int], b: list[int], page_size: int) -> int:
    """Tokens in the full blocks two prompts share (what a prefix cache can serve)."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common // page_size * page_size
