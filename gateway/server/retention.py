"""Agent-aware retention from the HTTP side: a response that ends in tool calls keeps its
conversation's pages ahead of LRU eviction for a TTL, because the agent comes back with the
tool's result and resends that whole prefix (cache/retention.py has the soft eviction order).

The TTL: the request's hint (``retention_seconds`` in the body, or the ``X-Retention-Seconds``
header; Anthropic's ``cache_control.ttl``), else the default learned from the agent's own tool
pauses and the prefix's recompute cost (cache/ttl_policy.py), which is the server's
``--retention`` (``ServerSettings.retention_s``) until enough pauses are seen, or always with
``--retention-learn off``. A pause is measured here: from a response of (tenant, agent) that
ended in tool calls (:func:`retain_tool_pause`) to that agent's next request
(:func:`note_arrival`); the agent label is ``X-Agent-Id`` or the body's ``user``. The policy
lives on ``app.state.retention_policy``, made on first use from the server's settings.
Retention runs in the background after the response: it never delays or fails a response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from starlette.requests import Request

from prefixgate.cache.ttl_policy import TTLPolicy
from prefixgate.engine.api import InvalidRequestError
from prefixgate.gateway.server.state import server_state

logger = logging.getLogger("prefixgate.server")

RETENTION_HEADER = "X-Retention-Seconds"
MAX_RETENTION_S = 3600.0
_background: set[asyncio.Task[None]] = set()


def retention_policy(request: Request) -> TTLPolicy:
    """This app's learned-TTL policy (made on first use from its settings)."""
    app_state = request.app.state
    policy = getattr(app_state, "retention_policy", None)
    if policy is None:
        state = server_state(request)
        policy = TTLPolicy(state.settings.retention_s, learn=state.settings.retention_learn,
                           recompute=state.metrics.recompute_cost)
        app_state.retention_policy = policy
    return policy


def note_arrival(request: Request, tenant: str, agent: str | None) -> None:
    """(tenant, agent) sent a request: the tool pause it was on, if any, ends and is learned."""
    if agent is not None:
        retention_policy(request).request_arrived(tenant, agent)


def retention_ttl(request: Request, hint: float | None) -> float | None:
    """The TTL for this request's tool pause: header, else body hint, else None (the learned
    default, decided when the response ends: it depends on the prefix's length)."""
    header = request.headers.get(RETENTION_HEADER)
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise InvalidRequestError(f"{RETENTION_HEADER} must be a number of seconds",
                                      param=RETENTION_HEADER) from None
        if not 0 <= value <= MAX_RETENTION_S:
            raise InvalidRequestError(f"{RETENTION_HEADER} must be in [0, {MAX_RETENTION_S:g}]",
                                      param=RETENTION_HEADER)
        return value
    return hint


def retain_tool_pause(request: Request, tenant: str, agent: str | None, cache_salt: str | None,
                      token_ids: Sequence[int], ttl_s: float | None) -> None:
    """A response of (tenant, agent) ended in tool calls: its pause starts, and its prefix is
    retained for ``ttl_s`` (None = the learned default for this agent and prefix length)."""
    policy = retention_policy(request)
    policy.tool_call_ended(tenant, agent)
    if ttl_s is None:
        ttl_s = policy.ttl(tenant, agent, len(token_ids))
    retain_later(request, tenant, cache_salt, token_ids, ttl_s)


def retain_later(request: Request, tenant: str, cache_salt: str | None,
                 token_ids: Sequence[int], ttl_s: float) -> None:
    """Retain ``token_ids``'s cached full blocks for ``ttl_s`` once the engine lock is free."""
    if ttl_s <= 0 or not token_ids:
        return
    engine = server_state(request).engine

    async def run() -> None:
        try:
            await engine.retain(list(token_ids), tenant, cache_salt, ttl_s)
        except Exception:  # noqa: BLE001 - retention is an optimisation, never a failure
            logger.exception("retention of %d tokens failed", len(token_ids))

    task = asyncio.get_running_loop().create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)
