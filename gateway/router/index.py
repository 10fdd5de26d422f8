"""The router's reads of the shared Redis index: prefix matches, heartbeats, fleet stats, and
the janitor that removes replicas which died without cleaning up.

Every call returns None (and marks Redis down) instead of raising when Redis fails; the router
then routes by load from its own view. ``up`` flips back on the next successful call (the
heartbeat poll retries every interval), so recovery needs nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from prefixgate.gateway.scaleout.fleet_stats import FleetStats, read_fleet_stats
from prefixgate.gateway.scaleout.heartbeat import Heartbeat
from prefixgate.gateway.scaleout.index_writer import reap_replica
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.redis_client import REDIS_ERRORS, connect, describe

logger = logging.getLogger("prefixgate.router")

# Walk a prompt's chain server-side, one round trip. KEYS: the chain's block-index keys, then
# (when ARGV[1] > 0) as many tier-entry keys. ARGV[1]: how many of the replica ids that follow
# load from the fleet tier (they come first). For each replica count the leading blocks whose
# set holds it, stopping at the first block no candidate holds; then, for each tier replica,
# the run of blocks after its own match that the tier holds (each key checked at most once).
_WALK_CHAIN = """
local n_tier = tonumber(ARGV[1])
local ids = {}
for i = 2, #ARGV do ids[i - 1] = ARGV[i] end
local n = #ids
local chain = #KEYS
if n_tier > 0 then chain = chain / 2 end
local matched = {}
for i = 1, n do matched[i] = 0 end
for k = 1, chain do
  local held = redis.call('SMISMEMBER', KEYS[k], unpack(ids))
  local any = false
  for i = 1, n do
    if matched[i] == k - 1 and held[i] == 1 then
      matched[i] = k
      any = true
    end
  end
  if not any then break end
end
local tier = {}
local exists = {}
for i = 1, n do
  tier[i] = 0
  if i <= n_tier then
    local k = matched[i] + 1
    while k <= chain do
      if exists[k] == nil then exists[k] = redis.call('EXISTS', KEYS[chain + k]) end
      if exists[k] ~= 1 then break end
      k = k + 1
    end
    tier[i] = k - 1 - matched[i]
  end
end
for i = 1, n do matched[n + i] = tier[i] end
return matched
"""


class ChainMatch(NamedTuple):
    """What the fleet holds of one prompt's chain, in blocks, by replica id."""

    pool: dict[str, int]  # leading blocks in the replica's own pool (hittable now)
    tier: dict[str, int]  # blocks after those the fleet tier holds (loadable; tier replicas)


class IndexReader:
    """Read side of :mod:`gateway.scaleout` for one router."""

    def __init__(self, redis_url: str, keys: RedisKeys, timeout_s: float = 0.25):
        self.redis_url = redis_url
        self.keys = keys
        # Lookups sit on the request path: a short timeout, then Redis counts as down.
        self.redis: Any = connect(redis_url, timeout_s=timeout_s)
        # Stats reads and the janitor move more data and are off the request path.
        self.bulk: Any = connect(redis_url, timeout_s=max(5.0, timeout_s))
        self._walk = self.redis.register_script(_WALK_CHAIN)
        self.up = True  # optimistic until a call fails
        self.failures = 0

    async def close(self) -> None:
        await self.redis.aclose()
        await self.bulk.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if self.up:
            logger.warning("Redis unreachable during %s (%s): routing by load until it is back",
                           what, describe(exc))
        self.up = False

    def _ok(self) -> None:
        if not self.up:
            logger.info("Redis is reachable again: cache-aware routing resumes")
        self.up = True

    async def matched_blocks(self, chain: Sequence[bytes],
                             replica_ids: Sequence[str]) -> dict[str, int] | None:
        """Leading blocks of ``chain`` each replica holds; None when Redis failed."""
        found = await self.lookup(chain, replica_ids)
        return None if found is None else found.pool

    async def lookup(self, chain: Sequence[bytes], replica_ids: Sequence[str],
                     tier_ids: Sequence[str] = ()) -> ChainMatch | None:
        """Per replica, the leading blocks of ``chain`` its pool holds and, for ``tier_ids``
        (replicas loading from the fleet's Redis tier), the blocks after those that the tier
        holds. One round trip; None when Redis failed."""
        loads_tier = set(tier_ids)
        tiered = [r for r in replica_ids if r in loads_tier]
        ordered = [*tiered, *(r for r in replica_ids if r not in loads_tier)]
        if not chain or not ordered:
            return ChainMatch(dict.fromkeys(replica_ids, 0), dict.fromkeys(replica_ids, 0))
        keys = [self.keys.block(h) for h in chain]
        if tiered:
            keys += [self.keys.tier_entry(h) for h in chain]
        try:
            counts = await self._walk(keys=keys, args=[len(tiered), *ordered])
        except REDIS_ERRORS as exc:
            self._failed("a prefix lookup", exc)
            return None
        self._ok()
        n = len(ordered)
        return ChainMatch({rid: int(c) for rid, c in zip(ordered, counts[:n], strict=True)},
                          {rid: int(c) for rid, c in zip(ordered, counts[n:], strict=True)})

    async def heartbeats(self) -> tuple[dict[str, Heartbeat], list[str]] | None:
        """(live heartbeats by replica id, every registered id); None when Redis failed."""
        try:
            registered = sorted(m.decode() for m in await self.redis.smembers(self.keys.replicas))
            raws = await self.redis.mget([self.keys.heartbeat(r) for r in registered]) if registered else []
        except REDIS_ERRORS as exc:
            self._failed("the heartbeat poll", exc)
            return None
        self._ok()
        beats = {}
        for replica_id, raw in zip(registered, raws, strict=True):
            if raw is None:
                continue
            try:
                beats[replica_id] = Heartbeat.from_json(raw)
            except ValueError as exc:
                logger.warning("replica %s: unreadable heartbeat ignored (%s)", replica_id, exc)
        return beats, registered

    async def fleet_stats(self) -> FleetStats | None:
        try:
            return await read_fleet_stats(self.bulk, self.keys)
        except REDIS_ERRORS as exc:
            logger.warning("could not read fleet stats from Redis: %s", describe(exc))
            return None

    async def reap(self, replica_id: str, lock_ms: int) -> int | None:
        """Remove a dead replica's index entries, if no other router is doing it."""
        try:
            if not await self.bulk.set(self.keys.janitor, replica_id, nx=True, px=lock_ms):
                return None
            removed = await reap_replica(self.bulk, self.keys, replica_id)
        except REDIS_ERRORS as exc:
            logger.warning("janitor: could not remove replica %s: %s", replica_id, describe(exc))
            return None
        logger.info("removed dead replica %s from the index (%d blocks)", replica_id, removed)
        return removed
