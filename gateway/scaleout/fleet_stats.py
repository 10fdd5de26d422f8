"""Fleet-wide prefix-cache counters in Redis: per replica, per tenant, per agent (and per agent
of each tenant, for a tenant's own view).

Each replica process writes its cumulative counters (and what it adapted in its clients'
requests, ``gateway/server/clients.py``) as one JSON snapshot under a key of its own (replica
id + start time), overwritten at most every ``stats_interval_s``. Writes are
idempotent, so a retried write, a Redis restart or a replica restart can neither double-count
nor lose counts that are still held: the router sums all snapshots. A restarted replica writes
under a new key, so fleet totals keep what its previous process counted (snapshots expire
after ``SNAPSHOT_TTL_S`` without a write).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixgate.cache.stats import CacheStats, HitStats
from prefixgate.gateway.scaleout.keys import RedisKeys

logger = logging.getLogger("prefixgate.scaleout")

SNAPSHOT_TTL_S = 7 * 24 * 3600


def _counts(stats: HitStats) -> list[int]:
    return stats.counts()


def snapshot_json(replica_id: str, cache: CacheStats,
                  clients: Mapping[str, int] | None = None) -> bytes:
    """One replica's cumulative counters as the JSON stored in Redis.

    Args:
        replica_id: whose.
        cache: the engine's hit counters.
        clients: the server's client counters (``ClientCounters.snapshot()``), if any.
    """
    return json.dumps({
        "replica": replica_id,
        "total": _counts(cache.total),
        "tenant": {name: _counts(s) for name, s in cache.per_tenant.items()},
        "agent": {name: _counts(s) for name, s in cache.per_agent.items()},
        # so the router can show a tenant its own agents only
        "tenant_agent": {tenant: {name: _counts(s) for name, s in agents.items()}
                         for tenant, agents in cache.per_tenant_agent.items()},
        "clients": dict(clients or {}),
    }, separators=(",", ":")).encode()


def queue_snapshot(pipe: Any, keys: RedisKeys, replica_id: str, epoch: str, payload: bytes) -> None:
    """Add the snapshot write to a pipeline."""
    key = keys.stats_snapshot(replica_id, epoch)
    pipe.set(key, payload, ex=SNAPSHOT_TTL_S)
    pipe.sadd(keys.stats_index, key)


@dataclass(frozen=True, slots=True)
class FleetStats:
    """Counters summed over every snapshot in Redis."""

    per_replica: Mapping[str, HitStats]
    per_tenant: Mapping[str, HitStats]
    per_agent: Mapping[str, HitStats]
    # tenant -> agent -> hits (absent from snapshots written before it existed)
    per_tenant_agent: Mapping[str, Mapping[str, HitStats]] = field(default_factory=dict)
    # counter name -> sum of every replica's client counters (gateway/server/clients.py)
    clients: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> HitStats:
        return _sum(self.per_replica.values())


def _sum(values: Any) -> HitStats:
    return sum(values, HitStats(0, 0, 0))


def _add(into: dict[str, HitStats], name: str, counts: Any) -> None:
    into[name] = into.get(name, HitStats(0, 0, 0)) + HitStats.from_counts(counts)


async def read_fleet_stats(redis: Any, keys: RedisKeys) -> FleetStats:
    """Sum every replica snapshot; raises redis errors to the caller."""
    names = sorted(await redis.smembers(keys.stats_index))
    raws = await redis.mget(names) if names else []
    per_replica: dict[str, HitStats] = {}
    per_tenant: dict[str, HitStats] = {}
    per_agent: dict[str, HitStats] = {}
    per_tenant_agent: dict[str, dict[str, HitStats]] = {}
    clients: dict[str, int] = {}
    expired = []
    for name, raw in zip(names, raws, strict=True):
        if raw is None:
            expired.append(name)
            continue
        try:
            data = json.loads(raw)
            _add(per_replica, str(data["replica"]), data["total"])
            for tenant, counts in data["tenant"].items():
                _add(per_tenant, tenant, counts)
            for agent, counts in data["agent"].items():
                _add(per_agent, agent, counts)
            for tenant, agents in data.get("tenant_agent", {}).items():
                for agent, counts in agents.items():
                    _add(per_tenant_agent.setdefault(tenant, {}), agent, counts)
            # absent from snapshots written before replicas published them
            add_counters(clients, data.get("clients", {}))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring malformed stats snapshot %r: %s", name, exc)
    if expired:
        await redis.srem(keys.stats_index, *expired)
    return FleetStats(per_replica, per_tenant, per_agent, per_tenant_agent, clients)


def add_counters(into: dict[str, int], counters: Mapping[str, Any]) -> None:
    """Add named integer counters (one replica's ``clients``) into a running sum.

    Raises:
        TypeError / ValueError: a counter that is not an integer (a malformed snapshot).
    """
    if not isinstance(counters, Mapping):
        raise TypeError(f"client counters are not an object: {counters!r}")
    for name, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"client counter {name!r} is not an integer: {value!r}")
        into[str(name)] = into.get(str(name), 0) + value
