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
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from prefixgate.engine.api import EngineError
from prefixgate.gateway.http import dashboard
from prefixgate.gateway.http.auth import Principal, authenticate, require_admin
from prefixgate.gateway.http.disconnect import ClientDisconnected, until_disconnect
from prefixgate.gateway.http.errors import install_exception_handlers
from prefixgate.gateway.http.metric_labels import CONTENT_TYPE
from prefixgate.gateway.http.request_id import RequestIdMiddleware
from prefixgate.gateway.http.slow_clients import BodyLimitMiddleware
from prefixgate.gateway.router.fleet import ReplicaState
from prefixgate.gateway.router.prompt import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    PROMPT_PATHS,
    RESPONSES_PATH,
    PromptKey,
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

logger = logging.getLogger("prefixgate.router")
router = APIRouter()

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


class _RetryElsewhere(Exception):
    """The replica failed before answering; the request may go to another one."""


async def forward(request: Request, path: str) -> Response:
    """Place and proxy one request (see the module docstring)."""
    state = router_state(request)
    assert state.client is not None
    body = await request.body()
    request_id: str = request.state.request_id
    headers = upstream_headers(request.headers.items(), request_id)
    began = time.perf_counter()
    key = await state.prompt_key(path, body, request.headers) if path in PROMPT_PATHS else None
    excluded: set[str] = set()
    for attempt in range(2):
        replica, reason = await _place(state, key, request_id, frozenset(excluded), attempt, began)
        upstream_request = build_request(state.client, request.method, replica.url + path,
                                         headers, body, request.query_params)
        try:
            upstream = await _send(request, state, replica, upstream_request, retry=attempt == 0)
        except _RetryElsewhere:
            excluded.add(replica.url)
            continue
        if upstream is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

        def done(replica: ReplicaState = replica) -> None:
            replica.inflight -= 1

        return ProxyResponse(upstream, done, {REPLICA_HEADER: replica.name, REASON_HEADER: reason})
    raise AssertionError("unreachable: the loop returns or raises")


async def _place(state: RouterState, key: PromptKey | None, request_id: str,
                 excluded: frozenset[str], attempt: int, began: float) -> tuple[ReplicaState, str]:
    """Choose a replica and record the decision; the replica counts the request in flight."""
    placed = await state.place(key, request_id, excluded)
    if placed is None:
        raise NoReplicaError("No replica is available right now; retry shortly.", code="no_replica")
    replica, decision, matched, tier_tokens = placed
    reason = decision.reason if attempt == 0 else "retry"
    if attempt == 0:
        state.metrics.decision_seconds.observe(time.perf_counter() - began)
    loads = {r.url: r.load for r in state.fleet.routable(state.redis_up)}
    state.record(request_id, replica, reason, matched, key, loads, tier_tokens)
    replica.inflight += 1
    return replica, reason


async def _send(request: Request, state: RouterState, replica: ReplicaState,
                upstream_request: httpx.Request, retry: bool) -> httpx.Response | None:
    """The replica's response headers (None: the client left first). On any failure the
    request is no longer in flight there; one that sent nothing back raises _RetryElsewhere
    when ``retry``, else a 502; a timeout is a 504."""
    assert state.client is not None
    try:
        return await until_disconnect(request, state.client.send(upstream_request, stream=True))
    except ClientDisconnected:
        replica.inflight -= 1
        logger.info("request %s: client disconnected before the response",
                    request.state.request_id)
        return None
    except (*_NOT_CONNECTED, *_DIED_BEFORE_ANSWER) as exc:
        replica.inflight -= 1
        raise _failed_before_answer(state, replica, exc, request.state.request_id, retry) from exc
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


def _failed_before_answer(state: RouterState, replica: ReplicaState, exc: Exception,
                          request_id: str, retry: bool) -> Exception:
    """Count and note a replica that sent nothing back; what to raise: retry, or a 502."""
    not_connected = isinstance(exc, _NOT_CONNECTED)
    state.metrics.upstream_errors.labels(replica.name,
                                         "connect" if not_connected else "no_response").inc()
    if not_connected:
        replica.mark_down(f"{type(exc).__name__}: {exc}")
    state.recent.forget(replica.url)  # nothing we sent it was computed
    if retry:
        state.metrics.retries.labels(replica.name).inc()
        logger.warning("request %s: replica %s failed before answering (%s); retrying "
                       "elsewhere", request_id, replica.name, type(exc).__name__)
        return _RetryElsewhere()
    return UpstreamError(f"Replica {replica.name} failed before answering "
                         f"({type(exc).__name__}).", code="replica_failed")


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


async def broadcast(request: Request, path: str) -> Response:
    """Send an admin action to every routable replica; the first refusal is passed on."""
    body = await request.body()
    headers = {**_auth_headers(request), "Content-Type": "application/json"}
    answers = await _fan_out(router_state(request), "POST", path, headers, body)
    results: dict[str, Any] = {}
    for replica, answer in answers:
        if not isinstance(answer, httpx.Response):
            raise UpstreamError(f"Replica {replica.name}: {type(answer).__name__}: {answer}",
                                code="replica_failed")
        if answer.status_code >= 400:
            return _passed_on(answer)  # e.g. 403 without the admin key: same for all
        results[replica.name] = answer.json()
    return JSONResponse({"object": "fleet.broadcast", "replicas": results})


# ---- placed and proxied --------------------------------------------------------------------
@router.post(CHAT_PATH, response_model=None)
async def chat_completions(request: Request) -> Response:
    return await forward(request, CHAT_PATH)


@router.post(COMPLETIONS_PATH, response_model=None)
async def completions(request: Request) -> Response:
    return await forward(request, COMPLETIONS_PATH)


@router.post(RESPONSES_PATH, response_model=None)
async def responses(request: Request) -> Response:
    return await forward(request, RESPONSES_PATH)


@router.get(RESPONSES_PATH + "/{response_id}", response_model=None)
@router.delete(RESPONSES_PATH + "/{response_id}", response_model=None)
async def stored_response(request: Request, response_id: str) -> Response:
    # any replica answers: stored responses are shared in Redis
    return await forward(request, f"{RESPONSES_PATH}/{response_id}")


@router.post(MESSAGES_PATH, response_model=None)
async def messages(request: Request) -> Response:
    return await forward(request, MESSAGES_PATH)


@router.post(MESSAGES_PATH + "/count_tokens", response_model=None)
async def count_tokens(request: Request) -> Response:
    return await forward(request, MESSAGES_PATH + "/count_tokens")


@router.post("/tokenize", response_model=None)
async def tokenize(request: Request) -> Response:
    return await forward(request, "/tokenize")


@router.post("/detokenize", response_model=None)
async def detokenize(request: Request) -> Response:
    return await forward(request, "/detokenize")


# ---- the fleet -----------------------------------------------------------------------------
@router.get("/v1/models", response_model=None)
async def list_models(request: Request) -> Response:
    """The union of the replicas' model lists (the first refusal when none answers 200)."""
    answers = await _fan_out(router_state(request), "GET", "/v1/models", _auth_headers(request))
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


@router.post("/v1/cache/pin", response_model=None)
async def pin(request: Request) -> Response:
    return await broadcast(request, "/v1/cache/pin")


@router.post("/v1/cache/unpin", response_model=None)
async def unpin(request: Request) -> Response:
    return await broadcast(request, "/v1/cache/unpin")


@router.post("/v1/cache/reset", response_model=None)
async def reset(request: Request) -> Response:
    return await broadcast(request, "/v1/cache/reset")


@router.get("/v1/cache/stats")
async def cache_stats(request: Request,
                      principal: Principal = Depends(authenticate)) -> dict[str, Any]:
    return await fleet_stats_json(router_state(request), _auth_headers(request), principal)


@router.get("/health", response_model=None)
async def health(request: Request) -> Response:
    state = router_state(request)
    redis_up = state.redis_up
    replicas = [
        {"name": r.name, "url": r.url, "routable": r.routable(redis_up),
         "reachable": r.reachable, "heartbeat": r.heartbeat_state, "load": r.load,
         "inflight": r.inflight}
        for r in state.fleet
    ]
    ok = bool(state.fleet.routable(redis_up))
    body = {"status": "ok" if ok else "unavailable", "policy": state.policy.name,
            "redis": state.redis_state, "replicas": replicas}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = router_state(request)
    if not state.settings.metrics_public:
        await require_admin(request)  # every tenant's labels; open when auth is off
    fleet = (await state.index.fleet_stats()
             if state.index is not None and state.index.up else None)
    return Response(state.metrics.render(fleet), media_type=CONTENT_TYPE)


def create_router_app(settings: RouterSettings, *, tokenizer: Any = None,
                      model_id: str | None = None) -> FastAPI:
    """Build the router app.

    Args:
        settings: router settings.
        tokenizer, model_id: the replicas' tokenizer and ``LoadedModel.name``; when omitted,
            read from ``settings.model`` without loading weights.
    """
    if tokenizer is None or model_id is None:
        from prefixgate.engine.loader.tokenizer_only import load_tokenizer_only

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
    app.state.keys = state.keys  # read by gateway.http.auth
    install_exception_handlers(app)
    app.include_router(router)
    # The replicas' dashboard, polling the fleet-wide /v1/cache/stats above.
    app.include_router(dashboard.router)
    app.add_middleware(BodyLimitMiddleware, limits=settings.limits)
    app.add_middleware(RequestIdMiddleware)
    return app
