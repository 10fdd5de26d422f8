"""A front door that places each request with NVIDIA Dynamo's KV router, fed by our KV events
(benchmarks.routing's ``dynamo`` policy; docs/fleet.md).

Dynamo's in-process ``SelectionService`` (``ai-dynamo-runtime``) subscribes to every replica's
vLLM-format ZMQ stream; for each request this app tokenises the prompt exactly as a replica will
(``gateway.router.prompt.PromptHasher``, the same as our router), asks Dynamo to select and
reserve a worker (KV overlap + the load it books), forwards the request to that replica
unchanged (streaming passes through byte for byte) and frees the reservation when the response
ends. A benchmark tool, not a product: no auth, no retries, OpenAI chat and completions only.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.router.prompt import PromptHasher
from prefixgate.gateway.router.proxy import ProxyResponse, build_request, upstream_headers


class DynamoWorker(NamedTuple):
    url: str  # http://host:port of the replica
    kv_events: str  # its ZMQ PUB endpoint
    replay: str | None  # its replay endpoint


def create_dynamo_router_app(workers: Sequence[DynamoWorker], *, tokenizer: Any, model_id: str,
                             served_model: str, page_size: int, hash_seed: int = 0) -> FastAPI:
    """The app; ``app.state.decisions`` lists the worker index chosen per request and
    ``app.state.overlaps`` (the most blocks any worker held, the blocks the chosen one held)
    per request: whether Dynamo saw the prefix, and whether it placed by it."""
    from dynamo.llm import SelectionService  # the optional dependency, only when used

    hasher = PromptHasher(tokenizer, model_id, page_size, hash_seed, KeyTable({}, None))
    decisions: list[int] = []
    overlaps: list[tuple[int, int]] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = SelectionService(indexer_threads=1)
        for worker_id, worker in enumerate(workers, 1):
            record = await service.upsert_worker({
                "worker_id": worker_id, "model_name": served_model, "endpoint": worker.url,
                "block_size": page_size, "kv_events_endpoint": worker.kv_events,
                "replay_endpoint": worker.replay})
            if record["lifecycle"] != "schedulable":
                raise RuntimeError(f"Dynamo will not schedule {worker.url}: {record}")
        app.state.service = service
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            app.state.client = client
            try:
                yield
            finally:
                service.shutdown()

    app = FastAPI(lifespan=lifespan)
    app.state.decisions = decisions
    app.state.overlaps = overlaps

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        reply = await request.app.state.client.get(workers[0].url + "/v1/models")
        return JSONResponse(reply.json(), status_code=reply.status_code)

    async def place(request: Request) -> Any:
        body = await request.body()
        path = request.url.path
        ids, _, _ = await asyncio.to_thread(hasher.token_ids, path, json.loads(body))
        selection_id = uuid.uuid4().hex
        service = request.app.state.service
        scores = await service.overlap_scores({"model_name": served_model, "token_ids": ids})
        picked = await service.select_and_reserve({
            "model_name": served_model, "token_ids": ids, "selection_id": selection_id})
        index = int(picked["worker_id"]) - 1
        decisions.append(index)
        best = max((int(w["device_blocks"]) for w in scores["workers"]), default=0)
        overlaps.append((best, int(picked["overlap"]["longest_matched"]) // page_size))
        client: httpx.AsyncClient = request.app.state.client
        upstream = await client.send(build_request(
            client, "POST", workers[index].url + path,
            upstream_headers(request.headers.items(), selection_id), body), stream=True)
        loop = asyncio.get_running_loop()

        def release() -> None:  # Dynamo's binding returns a future, not a coroutine
            asyncio.ensure_future(service.free_reservation(selection_id), loop=loop)

        return ProxyResponse(upstream, release)

    app.add_api_route("/v1/chat/completions", place, methods=["POST"])
    app.add_api_route("/v1/completions", place, methods=["POST"])
    return app
