"""The router app: OpenAI-compatible pass-through in front of several prefixgate replicas.

* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages``:
  placed by the policy (cache affinity vs load; a Responses turn continuing
  ``previous_response_id`` is hashed with its stored conversation, so it goes where that
  conversation's pages are), proxied byte for byte; retried once on another replica when the first one refused the
  connection or died before answering (nothing reached the client yet, so nothing duplicates).
* ``POST /tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``, ``GET`` / ``DELETE
  /v1/responses/{id}`` (stored in Redis, shared): to the least-loaded replica.
* ``GET /v1/models``: the union of the replicas' model lists.
* ``POST /v1/cache/pin``, ``/unpin``, ``/reset``: sent to every routable replica.
* ``GET /v1/cache/stats``, ``/metrics``, ``/health``: the fleet, aggregated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from prefixgate.gateway.engine.api import EngineError
from prefixgate.gateway.router.prompt import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    PROMPT_PATHS,
    RESPONSES_PATH,
)
from prefixgate.gateway.router.proxy import (
    REASON_HEADER,
    REPLICA_HEADER,
    ProxyResponse,
    build_request,
    upstream_headers,
)
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.router.state import RouterState
from prefixgate.gateway.router.stats import fleet_stats_json
from prefixgate.gateway.server import dashboard
from prefixgate.gateway.server.auth import Principal, authenticate, require_admin
from prefixgate.gateway.server.errors import install_exception_handlers
from prefixgate.gateway.server.generation import ClientDisconnected, until_disconnect
from prefixgate.gateway.server.metrics import CONTENT_TYPE
from prefixgate.gateway.server.request_id import RequestIdMiddleware
from prefixgate.gateway.server.slow_clients import BodyLimitMiddleware

logger = logging.getLogger("prefixgate.router")

CLIENT_CLOSED_REQUEST = 499
# Failures where the replica sent nothing back: re-sending elsewhere duplicates nothing the
# client saw. Refused connections also mark the replica down until a probe succeeds.
_NOT_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)
_DIED_BEFORE_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class NoReplicaError(EngineError):
    status_code = 503
    error_type = "service_unavailable"


class UpstreamError(EngineError):
    status_code = 502
    error_type = "upstream_error"


class UpstreamTimeout(EngineError):
    status_code = 504
    error_type = "upstream_error"


def router_state(request: Request) -> RouterState:
    return request.app.state.router


async def forward(request: Request, path: str) -> Response:
    """Place and proxy one request (see the module docstring)."""
    state = router_state(request)
    assert state.client is not None
    body = await request.body()
    request_id: str = request.state.request_id
    headers = upstream_headers(request.headers.items(), request_id)
    began = time.perf_counter()
    key = None
    if path in PROMPT_PATHS:
        key = await state.prompt_key(path, body, request.headers)
    excluded: set[str] = set()
    for attempt in range(2):
        placed = await state.place(key, request_id, frozenset(excluded))
        if placed is None:
            raise NoReplicaError("No replica is available right now; retry shortly.",
                                 code="no_replica")
        replica, decision, matched, tier_tokens = placed
        reason = decision.reason if attempt == 0 else "retry"
        if attempt == 0:
            state.metrics.decision_seconds.observe(time.perf_counter() - began)
        loads = {r.url: r.load for r in state.fleet.routable(state.redis_up)}
        state.record(request_id, replica, reason, matched, key, loads, tier_tokens)
        replica.inflight += 1
        upstream_request = build_request(state.client, request.method, replica.url + path,
                                         headers, body, request.query_params)
        try:
            upstream = await until_disconnect(request, state.client.send(upstream_request,
                                                                         stream=True))
        except ClientDisconnected:
            replica.inflight -= 1
            logger.info("request %s: client disconnected before the response", request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (*_NOT_CONNECTED, *_DIED_BEFORE_ANSWER) as exc:
            replica.inflight -= 1
            kind = "connect" if isinstance(exc, _NOT_CONNECTED) else "no_response"
            state.metrics.upstream_errors.labels(replica.name, kind).inc()
            if isinstance(exc, _NOT_CONNECTED):
                replica.mark_down(f"{type(exc).__name__}: {exc}")
            state.recent.forget(replica.url)  # nothing we sent it was computed
            excluded.add(replica.url)
            if attempt == 0:
                state.metrics.retries.labels(replica.name).inc()
                logger.warning("request %s: replica %s failed before answering (%s); retrying "
                               "elsewhere", request_id, replica.name, type(exc).__name__)
                continue
            raise UpstreamError(f"Replica {replica.name} failed before answering "
                                f"({type(exc).__name__}).", code="replica_failed") from exc
        except httpx.TimeoutException as exc:
            replica.inflight -= 1
            state.metrics.upstream_errors.labels(replica.name, "timeout").inc()
            raise UpstreamTimeout(f"Replica {replica.name} did not answer in time.",
                                  code="replica_timeout") from exc
        except httpx.HTTPError as exc:
            replica.inflight -= 1
            state.metrics.upstream_errors.labels(replica.name, "transport").inc()
            raise UpstreamError(f"Replica {replica.name}: {type(exc).__name__}.",
                                code="replica_failed") from exc
        except BaseException:
            replica.inflight -= 1
            raise

        def done(replica=replica) -> None:
            replica.inflight -= 1

        return ProxyResponse(upstream, done, {REPLICA_HEADER: replica.name, REASON_HEADER: reason})
    raise AssertionError("unreachable: the loop returns or raises")


def _auth_headers(request: Request) -> dict[str, str]:
    out = {"X-Request-Id": request.state.request_id}
    if "authorization" in request.headers:
        out["Authorization"] = request.headers["authorization"]
    return out


async def _fan_out(state: RouterState, method: str, path: str, headers: dict[str, str],
                   body: bytes | None = None) -> list[tuple[Any, httpx.Response | Exception]]:
    assert state.client is not None
    replicas = state.fleet.routable(state.redis_up)
    if not replicas:
        raise NoReplicaError("No replica is available right now; retry shortly.", code="no_replica")
    answers = await asyncio.gather(
        *(state.client.request(method, r.url + path, headers=headers, content=body)
          for r in replicas),
        return_exceptions=True)
    return list(zip(replicas, answers, strict=True))


def _passed_on(response: httpx.Response) -> Response:
    """A replica's (error) answer, as it was."""
    media = response.headers.get("content-type")
    return Response(response.content, status_code=response.status_code, media_type=media)


def create_router_app(settings: RouterSettings, *, tokenizer: Any = None,
                      model_id: str | None = None) -> FastAPI:
    """Build the router app.

    Args:
        settings: router settings.
        tokenizer, model_id: the replicas' tokenizer and ``LoadedModel.name``; when omitted,
            read from ``settings.model`` without loading weights.
    """
    if tokenizer is None or model_id is None:
        from prefixgate.gateway.engine.loader.tokenizer_only import load_tokenizer_only

        loaded = load_tokenizer_only(settings.model)
        tokenizer, model_id = loaded.tokenizer, loaded.model_id
        tokenizer.parse_special_tokens = settings.parse_special_tokens
    state = RouterState(settings, tokenizer, model_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="prefixgate router", description="Cache-aware router over prefixgate "
                  "replicas", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.router = state
    app.state.keys = state.keys  # read by gateway.server.auth
    install_exception_handlers(app)

    @app.post(CHAT_PATH, response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await forward(request, CHAT_PATH)

    @app.post(COMPLETIONS_PATH, response_model=None)
    async def completions(request: Request) -> Response:
        return await forward(request, COMPLETIONS_PATH)

    @app.post(RESPONSES_PATH, response_model=None)
    async def responses(request: Request) -> Response:
        return await forward(request, RESPONSES_PATH)

    @app.get(RESPONSES_PATH + "/{response_id}", response_model=None)
    @app.delete(RESPONSES_PATH + "/{response_id}", response_model=None)
    async def stored_response(request: Request, response_id: str) -> Response:
        # any replica answers: stored responses are shared in Redis
        return await forward(request, f"{RESPONSES_PATH}/{response_id}")

    @app.post(MESSAGES_PATH, response_model=None)
    async def messages(request: Request) -> Response:
        return await forward(request, MESSAGES_PATH)

    @app.post(MESSAGES_PATH + "/count_tokens", response_model=None)
    async def count_tokens(request: Request) -> Response:
        return await forward(request, MESSAGES_PATH + "/count_tokens")

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        return await forward(request, "/tokenize")

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> Response:
        return await forward(request, "/detokenize")

    @app.get("/v1/models", response_model=None)
    async def list_models(request: Request) -> Response:
        answers = await _fan_out(state, "GET", "/v1/models", _auth_headers(request))
        cards: dict[str, Any] = {}
        failed: httpx.Response | None = None
        for _, answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                for card in answer.json().get("data", []):
                    cards.setdefault(card["id"], card)
            elif isinstance(answer, httpx.Response) and failed is None:
                failed = answer
        if cards:
            return JSONResponse({"object": "list", "data": list(cards.values())})
        if failed is not None:
            return _passed_on(failed)
        raise NoReplicaError("No replica answered /v1/models.", code="no_replica")

    async def broadcast(request: Request, path: str) -> Response:
        body = await request.body()
        headers = {**_auth_headers(request), "Content-Type": "application/json"}
        answers = await _fan_out(state, "POST", path, headers, body)
        results: dict[str, Any] = {}
        for replica, answer in answers:
            if not isinstance(answer, httpx.Response):
                raise UpstreamError(f"Replica {replica.name}: {type(answer).__name__}: {answer}",
                                    code="replica_failed")
            if answer.status_code >= 400:
                return _passed_on(answer)  # e.g. 403 without the admin key: same for all
            results[replica.name] = answer.json()
        return JSONResponse({"object": "fleet.broadcast", "replicas": results})

    @app.post("/v1/cache/pin", response_model=None)
    async def pin(request: Request) -> Response:
        return await broadcast(request, "/v1/cache/pin")

    @app.post("/v1/cache/unpin", response_model=None)
    async def unpin(request: Request) -> Response:
        return await broadcast(request, "/v1/cache/unpin")

    @app.post("/v1/cache/reset", response_model=None)
    async def reset(request: Request) -> Response:
        return await broadcast(request, "/v1/cache/reset")

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request,
                          principal: Principal = Depends(authenticate)) -> dict[str, Any]:
        return await fleet_stats_json(state, _auth_headers(request), principal)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        redis_up = state.redis_up
        replicas = [
            {"name": r.name, "url": r.url, "routable": r.routable(redis_up),
             "reachable": r.reachable, "heartbeat": "fresh" if r.heartbeat_fresh
             else ("expired" if r.heartbeat_seen else "none"), "load": r.load,
             "inflight": r.inflight}
            for r in state.fleet
        ]
        ok = bool(state.fleet.routable(redis_up))
        body = {"status": "ok" if ok else "unavailable", "policy": state.policy.name,
                "redis": "off" if state.index is None else ("up" if redis_up else "down"),
                "replicas": replicas}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not state.settings.metrics_public:
            await require_admin(request)  # every tenant's labels; open when auth is off
        fleet = (await state.index.fleet_stats()
                 if state.index is not None and state.index.up else None)
        return Response(state.metrics.render(fleet), media_type=CONTENT_TYPE)

    # The replicas' dashboard, polling the fleet-wide /v1/cache/stats above.
    app.include_router(dashboard.router)
    app.add_middleware(BodyLimitMiddleware, limits=settings.limits)
    app.add_middleware(RequestIdMiddleware)
    return app
