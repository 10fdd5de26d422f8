"""``GET /v1/cache/stats`` on the router: prefix-cache hits over the whole fleet.

Counters come from Redis, where every replica adds its deltas (they include replicas that
left); when Redis is down (or not configured) the router asks each routable replica instead
and sums what they answer. Either way ``per_replica`` adds the router's own view.

With auth on, a tenant key sees its own tenant only, as on a replica: its counters and agents
(Redis keeps them per tenant; the replicas filter what they answer by the forwarded key), and no
per-replica hit counters of the whole fleet.

``clients`` (what the replicas adapted in their clients' requests, gateway/server/clients.py)
is the sum over the fleet, shown as a replica shows its own: to the admin, or to anyone with
auth off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from prefixgate.cache.stats import HitStats
from prefixgate.gateway.http.auth import Principal
from prefixgate.gateway.http.stats_json import busiest, hit_json, scope_json
from prefixgate.gateway.router.fleet import ReplicaState
from prefixgate.gateway.router.state import RouterState
from prefixgate.gateway.scaleout.fleet_stats import add_counters

MAX_STATS_AGENTS = 200

logger = logging.getLogger("prefixgate.router")


def _add(into: dict[str, HitStats], name: str, stats: HitStats) -> None:
    into[name] = into.get(name, HitStats(0, 0, 0)) + stats


def _hits(raw: Mapping[str, Any]) -> HitStats:
    return HitStats(*(int(raw.get(f, 0)) for f in (
        "requests", "query_tokens", "hit_tokens", "retention_hits", "retention_hit_tokens")))


@dataclass(slots=True)
class _Counters:
    """Hit counters of the caller's view: where they came from, per replica, tenant, agent;
    and the replicas' client counters summed."""

    source: str  # "redis" or "replicas"
    per_replica: dict[str, HitStats]
    per_tenant: dict[str, HitStats]
    per_agent: dict[str, HitStats]
    clients: dict[str, int] = field(default_factory=dict)


async def _from_replicas(state: RouterState, headers: Mapping[str, str]) -> _Counters:
    """The counters summed from the replicas' own /v1/cache/stats."""
    assert state.client is not None
    replicas = state.fleet.routable(state.redis_up)
    answers = await asyncio.gather(
        *(state.client.get(r.url + "/v1/cache/stats", headers=dict(headers), timeout=5.0)
          for r in replicas),
        return_exceptions=True)
    counters = _Counters("replicas", {}, {}, {})
    for replica, answer in zip(replicas, answers, strict=True):
        if isinstance(answer, httpx.HTTPError) or not isinstance(answer, httpx.Response):
            continue  # unreachable now: absent from this answer, the probe will notice
        if answer.status_code != 200:
            continue
        body = answer.json()
        counters.per_replica[replica.name] = _hits(body.get("global", {}))
        for name, raw in (body.get("per_tenant") or {}).items():
            _add(counters.per_tenant, name, _hits(raw))
        for name, raw in (body.get("per_agent") or {}).items():
            _add(counters.per_agent, name, _hits(raw))
        # present where the replica shows them to this caller (admin, or auth off)
        try:
            add_counters(counters.clients, body.get("clients") or {})
        except TypeError as exc:  # a replica of another version: its hits still count
            logger.warning("ignoring replica %s's client counters: %s", replica.name, exc)
    return counters


async def _counters(state: RouterState, headers: Mapping[str, str],
                    principal: Principal) -> _Counters:
    fleet = await state.index.fleet_stats() if state.index is not None and state.index.up else None
    if fleet is None:
        # the replicas answered the forwarded key: already this caller's view
        return await _from_replicas(state, headers)
    if principal.is_admin:
        return _Counters("redis", dict(fleet.per_replica), dict(fleet.per_tenant),
                         dict(fleet.per_agent), dict(fleet.clients))
    # NOTE: Redis holds every tenant's counters; a tenant gets its own only, and the
    # per-replica totals (everyone's traffic) are not its to see.
    tenant = principal.tenant
    per_tenant = {tenant: fleet.per_tenant[tenant]} if tenant in fleet.per_tenant else {}
    return _Counters("redis", {}, per_tenant, dict(fleet.per_tenant_agent.get(tenant, {})))


def _replica_json(replica: ReplicaState, redis_up: bool, stats: HitStats | None) -> dict[str, Any]:
    """The router's view of one replica, with its heartbeat's pool and its hit counters."""
    entry: dict[str, Any] = {
        "url": replica.url,
        "routable": replica.routable(redis_up),
        "reachable": replica.reachable,
        "heartbeat": replica.heartbeat_state,
        "load": replica.load,
        "inflight": replica.inflight,
        "routed": replica.routed,
    }
    beat = replica.heartbeat if replica.heartbeat_fresh else None
    if beat is not None:
        entry.update(num_running=beat.num_running, num_waiting=beat.num_waiting,
                     num_pages=beat.num_pages, pages_free=beat.pages_free,
                     pages_used=beat.pages_used)
    if replica.mismatch:
        entry["hash_mismatch"] = replica.mismatch
    if stats is not None:
        entry.update(hit_json(stats))
    return entry


def _replicas_json(state: RouterState, per_replica: dict[str, HitStats]) -> dict[str, Any]:
    """Every replica of the fleet, then the ones that left (still in the fleet totals)."""
    rest = dict(per_replica)
    out = {r.name: _replica_json(r, state.redis_up, rest.pop(r.name, None)) for r in state.fleet}
    for name, stats in rest.items():
        out[name] = {"departed": True, **hit_json(stats)}
    return out


async def fleet_stats_json(state: RouterState, headers: Mapping[str, str],
                           principal: Principal) -> dict[str, Any]:
    counters = await _counters(state, headers, principal)
    total = sum(counters.per_replica.values(), HitStats(0, 0, 0))
    if not principal.is_admin:
        total = counters.per_tenant.get(principal.tenant, HitStats(0, 0, 0))
    # Fleet page totals and load from fresh heartbeats (what the dashboard's pool view shows).
    beats = [r.heartbeat for r in state.fleet if r.heartbeat_fresh and r.heartbeat is not None]
    num_pages = sum(b.num_pages for b in beats)
    pages_used = sum(b.pages_used for b in beats)
    out = {
        "object": "fleet.cache.stats",
        **scope_json(principal, state.settings.auth_enabled),
        "source": counters.source,
        "page_size": state.settings.page_size,
        "num_pages": num_pages,
        "pages_used": pages_used,
        "kv_cache_usage": pages_used / num_pages if num_pages else 0.0,
        "engine": {"num_running": sum(b.num_running for b in beats),
                   "num_waiting": sum(b.num_waiting for b in beats)},
        "global": hit_json(total),
        "per_tenant": busiest(counters.per_tenant, max(len(counters.per_tenant), 1)),
        "per_agent": busiest(counters.per_agent, MAX_STATS_AGENTS),
        "per_replica": _replicas_json(state, counters.per_replica),
        "router": {
            "policy": state.policy.name,
            "redis": state.redis_state,
            "decisions": dict(sorted(state.reason_counts.items())),
        },
    }
    # NOTE: counted over every tenant: the replicas' own rule (routes_cache._shared_json)
    if principal.is_admin or not state.settings.auth_enabled:
        out["clients"] = dict(sorted(counters.clients.items()))
    return out
