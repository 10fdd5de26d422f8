"""Writes one replica's block index to Redis: batched event deltas, full resyncs, removal.

Every write is a non-transactional pipeline (one round trip per batch). A failure part-way
leaves the index partly updated; the publisher then resynchronises, which converges because
every operation is an idempotent set add/remove.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prefixgate.cache.events import BlockStored, CacheEvent
from prefixgate.gateway.scaleout.keys import RedisKeys

BATCH = 2000  # set members per SADD/SREM command (keeps single commands small)
PIPELINE = 10_000  # commands per round trip (a resync of a big index takes several)


def coalesce(events: Iterable[CacheEvent]) -> tuple[list[bytes], list[bytes]]:
    """(stored, removed) hashes after applying ``events`` in order: only the last event per
    hash matters, and operations on different hashes commute."""
    final: dict[bytes, bool] = {}
    for event in events:
        final[event.block_hash] = isinstance(event, BlockStored)
    stored = [h for h, present in final.items() if present]
    removed = [h for h, present in final.items() if not present]
    return stored, removed


def _chunks(items: Sequence[bytes], size: int = BATCH) -> Iterable[Sequence[bytes]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class IndexWriter:
    """One replica's view of the shared index.

    Args:
        redis: a ``redis.asyncio.Redis`` (bytes responses).
        keys: the key schema.
        replica_id: this replica's id (a member of every block set it holds).
    """

    def __init__(self, redis: Any, keys: RedisKeys, replica_id: str):
        self.redis = redis
        self.keys = keys
        self.replica_id = replica_id

    async def apply(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Publish a batch of changes in one pipeline."""
        if not stored and not removed:
            return
        rid = self.replica_id
        mine = self.keys.replica_blocks(rid)
        for part in _chunks(stored, PIPELINE):
            pipe = self.redis.pipeline(transaction=False)
            for block_hash in part:
                pipe.sadd(self.keys.block(block_hash), rid)
            for chunk in _chunks(part):
                pipe.sadd(mine, *chunk)
            await pipe.execute()
        for part in _chunks(removed, PIPELINE):
            pipe = self.redis.pipeline(transaction=False)
            for block_hash in part:
                pipe.srem(self.keys.block(block_hash), rid)
            for chunk in _chunks(part):
                pipe.srem(mine, *chunk)
            await pipe.execute()

    async def published(self) -> set[bytes]:
        """The hashes Redis currently lists for this replica."""
        return set(await self.redis.smembers(self.keys.replica_blocks(self.replica_id)))

    async def resync(self, held: Iterable[bytes]) -> tuple[int, int]:
        """Make the index say exactly ``held`` for this replica; returns (added, removed)."""
        held = set(held)
        old = await self.published()
        stale = sorted(old - held)
        fresh = sorted(held - old)
        # Re-add everything held: a block set may have lost us while our own set did not
        # (a partial pipeline, a janitor racing our restart). SADD of a member is a no-op.
        await self.apply(sorted(held), stale)
        await self.redis.sadd(self.keys.replicas, self.replica_id)
        return len(fresh), len(stale)

    async def remove(self) -> int:
        """Take this replica out of the index, heartbeat and registry; returns blocks removed."""
        old = sorted(await self.published())
        await self.apply((), old)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.replica_blocks(self.replica_id))
        pipe.delete(self.keys.heartbeat(self.replica_id))
        pipe.srem(self.keys.replicas, self.replica_id)
        await pipe.execute()
        return len(old)


async def reap_replica(redis: Any, keys: RedisKeys, replica_id: str) -> int:
    """Remove a dead replica's entries (the router's janitor); returns blocks removed."""
    return await IndexWriter(redis, keys, replica_id).remove()
