"""NVIDIA Dynamo's KV router, fed by our events (#40.1): Dynamo's ``SelectionService``
(PyPI ``ai-dynamo-runtime``, CPU-only, offline on loopback) subscribes to two live prefixgate
replicas' ZMQ streams (and their replay sockets: it joins after the first batch) and picks the
replica that holds a prompt's prefix; a cache_salt's prefix stays invisible to it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from prefixgate.gateway.scaleout.kv_events.config import parse_kv_events_config
from prefixgate.gateway.server import ServerSettings, create_app
from prefixgate.gateway.server.launch import GatewayServer, ServersThread, uvicorn_config
from tests.scaleout.conftest import PAGE_SIZE, make_engine

pytestmark = pytest.mark.slow

try:
    from dynamo.llm import SelectionService
except ImportError as exc:  # `make test` installs it (Makefile: ai-dynamo-runtime --no-deps)
    SelectionService = None
    DYNAMO_MISSING = f"SKIPPED LOUDLY: ai-dynamo-runtime cannot be imported ({exc}); `make setup`"

CONFIG = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
          '"replay_endpoint": "tcp://127.0.0.1:*"}')


@pytest.fixture(scope="module")
def replicas(loaded_model, one_torch_thread):
    if SelectionService is None:
        pytest.skip(DYNAMO_MISSING)
    servers, engines = [], []
    for _ in range(2):
        settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning",
                                  kv_events=parse_kv_events_config(CONFIG))
        engine = make_engine(loaded_model, num_pages=64)
        app = create_app(engine, settings, manage_engine=False)
        servers.append(GatewayServer(uvicorn_config(app, settings), engine, settings))
        engines.append(engine)
    thread = ServersThread(servers, engines, "prefixgate-dynamo-replicas")
    thread.start_and_wait()
    try:
        yield servers
    finally:
        thread.stop()


def _prompt(topic: str) -> str:
    return f"Notes on {topic}: " + " ".join(f"{topic}{j}" for j in range(50))


def test_dynamo_picks_the_replica_holding_the_prefix(replicas):
    urls = [s.base_url for s in replicas]
    model = replicas[0].config.app.state.server.model_name

    async def scenario() -> None:
        service = SelectionService(indexer_threads=1)
        try:
            for worker_id, server in enumerate(replicas, 1):
                events = server.config.app.state.kv_events
                record = await service.upsert_worker({
                    "worker_id": worker_id, "model_name": model, "endpoint": server.base_url,
                    "block_size": PAGE_SIZE, "kv_events_endpoint": events.endpoint,
                    "replay_endpoint": events.replay_endpoint})
                assert record["lifecycle"] == "schedulable", record
            async with httpx.AsyncClient(timeout=120) as client:
                async def ids(prompt: str) -> list[int]:
                    reply = await client.post(urls[0] + "/v1/completions/render",
                                              json={"model": model, "prompt": prompt})
                    return reply.json()[0]["token_ids"]

                async def run(url: str, prompt: str, **extra) -> None:
                    reply = await client.post(url + "/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 1, **extra})
                    reply.raise_for_status()

                async def choice(token_ids: list[int]) -> tuple[int, int]:
                    picked = await service.select({"model_name": model, "token_ids": token_ids})
                    return picked["worker_id"], picked["overlap"]["longest_matched"]

                async def settled(token_ids: list[int], want: tuple[int, int]) -> None:
                    for _ in range(100):  # the events travel asynchronously
                        if await choice(token_ids) == want:
                            return
                        await asyncio.sleep(0.05)
                    assert await choice(token_ids) == want

                on_b, on_a = _prompt("river"), _prompt("mountain")
                b_ids, a_ids = await ids(on_b), await ids(on_a)
                await run(urls[1], on_b)
                await run(urls[0], on_a)
                # each prompt's every full block is cached where it ran, nowhere else
                await settled(b_ids, (2, len(b_ids) // PAGE_SIZE * PAGE_SIZE))
                await settled(a_ids, (1, len(a_ids) // PAGE_SIZE * PAGE_SIZE))
                # a salted prefix on replica 2: Dynamo never learns it (no overlap anywhere)
                secret = _prompt("secret")
                await run(urls[1], secret, cache_salt="tenant-x")
                await asyncio.sleep(0.3)
                overlap = await service.overlap_scores({"model_name": model,
                                                        "token_ids": await ids(secret)})
                assert all(w["device_blocks"] == 0 for w in overlap["workers"]), overlap
        finally:
            service.shutdown()

    asyncio.run(scenario())
    events = [s.config.app.state.kv_events.status for s in replicas]
    assert all(e.replays >= 1 and e.errors == 0 for e in events), events  # joined late: replay


def test_the_benchmark_front_door_places_with_dynamo(replicas, loaded_model):
    """benchmarks.routing's dynamo placement: a repeated prompt goes back to the replica that
    cached it (Dynamo saw its blocks in the events), and the reply passes through unchanged."""
    import uvicorn

    from benchmarks.dynamo_router import DynamoWorker, create_dynamo_router_app
    from prefixgate.gateway.http.bound_server import BoundServer
    from tests.scaleout.conftest import free_port

    workers = [DynamoWorker(s.base_url, s.config.app.state.kv_events.endpoint,
                            s.config.app.state.kv_events.replay_endpoint) for s in replicas]
    model = replicas[0].config.app.state.server.model_name
    app = create_dynamo_router_app(workers, tokenizer=loaded_model.tokenizer,
                                   model_id=loaded_model.name, served_model=model,
                                   page_size=PAGE_SIZE)
    door = BoundServer(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                      log_level="warning", lifespan="on"))
    thread = ServersThread([door], [], "dynamo-front-door")
    thread.start_and_wait()
    try:
        with httpx.Client(base_url=door.base_url, timeout=120) as client:
            chat = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [
                {"role": "user", "content": _prompt("harbour")}]}
            first = client.post("/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            cached = 0
            for _ in range(50):  # until Dynamo has the first reply's blocks from the events
                again = client.post("/v1/chat/completions", json=chat).json()
                cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
                if cached:
                    break
            assert cached >= again["usage"]["prompt_tokens"] // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
            decisions = app.state.decisions
            assert decisions[-1] == decisions[0]  # back where its prefix lives
    finally:
        thread.stop()
