"""A real fleet on loopback: a ``redis-server`` subprocess, two replicas (in-process uvicorn,
sharing one loaded model, each with its own engine and KV pool) that publish to it, and a
cache-aware router in front of them.

Heartbeat TTLs are 1 s so health changes show within a second or two.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.router.app import create_router_app
from prefixgate.gateway.router.launch import router_server
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config

PAGE_SIZE = 16
NUM_PAGES = 256
HEARTBEAT_TTL_S = 1.0
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll until ``predicate()`` is truthy; the deadline only bounds a failure, whose message
    ends with ``explain()`` (the state that was waited on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{detail}")
        time.sleep(interval_s)


class RedisServer:
    """A redis-server subprocess on a fixed loopback port that tests may kill and restart."""

    def __init__(self, binary: str, port: int):
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)

        def ready() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(ready, 20, "redis-server to accept connections")
        client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no persistence; the data is gone."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def redis_binary() -> str:
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if binary is None:
        pytest.skip("SKIPPED LOUDLY: redis-server is not installed (`make test` installs it with "
                    "apt-get; `apt-get install redis-server`)")
    return binary


@contextlib.contextmanager
def started_redis() -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), free_port())
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.kill()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's Redis: the fleet's live index is in it, so tests here only add and remove
    keys of their own (their own namespace); a test that kills Redis or changes its config
    takes ``own_redis`` instead."""
    with started_redis() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for this test alone, to kill or reconfigure. On the session's server an
    ``allkeys-lru`` eviction drops the fleet's index keys behind its publishers' backs (they
    resync only once a heartbeat's audit notices) and later fleet tests see a gap."""
    with started_redis() as server:
        yield server


def make_engine(loaded_model, num_pages: int = NUM_PAGES):
    """An engine of its own (KV pool, cache, thread) over the session's one loaded model
    (``loaded_model`` comes from the root plugin tests/model_fixtures.py)."""
    from prefixgate.engine.async_engine import build_engine

    return build_engine(EngineConfig(num_pages=num_pages, page_size=PAGE_SIZE, max_waiting=128),
                        loaded=loaded_model)


@dataclass
class Replica:
    replica_id: str
    url: str
    engine: Any
    app: Any

    @property
    def publisher(self):
        return self.app.state.publisher


@dataclass
class Fleet:
    redis: RedisServer
    replicas: list[Replica]
    router_url: str
    router_app: Any
    model_id: str
    tokenizer: Any

    @property
    def router(self):
        return self.router_app.state.router


def index_mismatch(client: redis.Redis, replica: Replica, keys: RedisKeys = RedisKeys()) -> str:
    """Empty when Redis lists exactly the blocks the replica's engine holds (in its own set and
    in each block's set); otherwise what differs, the publisher's status and Redis's eviction
    facts (a failure message)."""
    held = set(replica.engine.cached_block_hashes())
    mine = keys.replica_blocks(replica.replica_id)
    published = set(client.smembers(mine))
    pipe = client.pipeline(transaction=False)
    ordered = sorted(held)
    for block_hash in ordered:
        pipe.sismember(keys.block(block_hash), replica.replica_id)
    unlisted = [h for h, listed in zip(ordered, pipe.execute(), strict=True) if not listed]
    missing, extra = held - published, published - held
    if not (missing or extra or unlisted):
        return ""

    def some(hashes) -> str:
        return f"{len(hashes)} {[h.hex() for h in sorted(hashes)[:3]]}"

    info = client.info("stats")
    policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    return (f"{replica.replica_id}: engine holds {len(held)}, {mine} lists {len(published)}; "
            f"held but not listed {some(missing)}; listed but not held {some(extra)}; held "
            f"but missing from their block set {some(unlisted)}; publisher {replica.publisher.status}"
            f"; Redis evicted_keys={info.get('evicted_keys')} maxmemory-policy={policy} "
            f"keys={client.dbsize()}")


def replica_settings(redis_url: str, replica_id: str, port: int) -> ServerSettings:
    return ServerSettings(host="127.0.0.1", port=port, log_level="warning", redis_url=redis_url,
                          replica_id=replica_id, advertise_url=f"http://127.0.0.1:{port}",
                          heartbeat_ttl_s=HEARTBEAT_TTL_S)


def router_settings(urls: list[str], redis_url: str | None, **overrides: Any) -> RouterSettings:
    values: dict[str, Any] = dict(replicas=tuple(urls), redis_url=redis_url, host="127.0.0.1",
                                  port=0, page_size=PAGE_SIZE, heartbeat_ttl_s=HEARTBEAT_TTL_S,
                                  health_interval_s=0.2, log_level="warning")
    values.update(overrides)
    return RouterSettings(**values)


@contextlib.contextmanager
def running_router(settings: RouterSettings, tokenizer: Any, model_id: str):
    """A router app served on a free port in its own thread; yields (url, app)."""
    app = create_router_app(settings, tokenizer=tokenizer, model_id=model_id)
    server = router_server(settings, app)
    thread = ServersThread([server], [], "prefixgate-test-router")
    thread.start_and_wait()
    try:
        yield server.base_url, app
    finally:
        thread.stop()


@pytest.fixture(scope="session")
def one_torch_thread() -> Iterator[None]:
    """Two engines step concurrently in this process on a small shared machine: torch's
    intra-op threads would oversubscribe the cores (spin-waits made steps ~10x slower here)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fleet(redis_server, loaded_model, one_torch_thread) -> Iterator[Fleet]:
    replicas = []
    servers = []
    for replica_id in ("replica-a", "replica-b"):
        port = free_port()
        settings = replica_settings(redis_server.url, replica_id, port)
        engine = make_engine(loaded_model)
        app = create_app(engine, settings, manage_engine=False)
        servers.append(GatewayServer(uvicorn_config(app, settings), engine, settings))
        replicas.append(Replica(replica_id, f"http://127.0.0.1:{port}", engine, app))
    thread = ServersThread(servers, [r.engine for r in replicas], "prefixgate-test-replicas")
    thread.start_and_wait()
    tokenizer = loaded_model.tokenizer
    settings = router_settings([r.url for r in replicas], redis_server.url)
    try:
        with running_router(settings, tokenizer, loaded_model.name) as (url, app):
            fleet = Fleet(redis_server, replicas, url, app, loaded_model.name, tokenizer)
            wait_for(lambda: all(r.heartbeat_fresh for r in fleet.router.fleet), 30,
                     "both replicas' heartbeats at the router")
            yield fleet
    finally:
        thread.stop()


def reset_caches(urls: list[str]) -> None:
    """Drop every unreferenced cached page on each replica (between workload runs)."""
    with httpx.Client(timeout=60) as client:
        for url in urls:
            client.post(url + "/v1/cache/reset").raise_for_status()


def spawn_replica(redis_url: str, replica_id: str, port: int, num_pages: int = 128
                  ) -> subprocess.Popen:
    """``prefixgate serve`` in a subprocess (its own model load), publishing to Redis."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable,
         "-m", "prefixgate.gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--num-pages", str(num_pages), "--page-size", str(PAGE_SIZE),
         "--redis-url", redis_url, "--replica-id", replica_id,
         "--advertise-url", f"http://127.0.0.1:{port}", "--heartbeat-ttl", str(HEARTBEAT_TTL_S),
         "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def kill_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
