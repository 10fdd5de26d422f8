"""Writes one replica's block index to Redis: batched event deltas, full resyncs, removal,
and the audit that notices when Redis lost part of it.

Every write is a non-transactional pipeline (one round trip per batch). A failure part-way
leaves the index partly updated; the publisher then resynchronises, which converges because
every operation is an idempotent set add/remove.

Index keys have no TTL, yet Redis can still drop them: an ``allkeys-*`` maxmemory policy, a
manual DEL, a ``FLUSHDB`` of someone else's. Nothing tells the writer, so the publisher audits
on every heartbeat (:meth:`IndexWriter.audit`): the size of the replica's own set against what
it published, and a rotating slice of the block keys, so every block key is checked within
``ceil(blocks / AUDIT_BLOCKS)`` beats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prefixgate.cache.events import BlockStored, CacheEvent
from prefixgate.gateway.scaleout.keys import RedisKeys

BATCH = 2000  # set members per SADD/SREM command (keeps single commands small)
PIPELINE = 10_000  # commands per round trip (a resync of a big index takes several)
AUDIT_BLOCKS = 512  # block keys checked per heartbeat (one pipelined round trip)


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
        # NOTE: the size this replica's own set has if Redis kept every write: counted from
        # what each SADD/SREM on it changed, reset by every resync
        self.num_published = 0

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
            results = await pipe.execute()
            self.num_published += sum(results[len(part):])  # members new to our own set
        for part in _chunks(removed, PIPELINE):
            pipe = self.redis.pipeline(transaction=False)
            for block_hash in part:
                pipe.srem(self.keys.block(block_hash), rid)
            for chunk in _chunks(part):
                pipe.srem(mine, *chunk)
            results = await pipe.execute()
            self.num_published -= sum(results[len(part):])

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
        self.num_published = len(held)  # the set is exactly ``held`` now
        return len(fresh), len(stale)

    async def audit(self, cursor: int, count: int = AUDIT_BLOCKS) -> tuple[int, str | None]:
        """Check that Redis still holds what this replica published.

        Args:
            cursor: where the rotating check of the block keys goes on (0: from the start;
                the previous call's returned cursor after that).
            count: about how many block keys to check (a hint to SSCAN).

        Returns:
            (the cursor for the next call, None) when nothing is missing; (0, what is
            missing) when Redis lost part of the index (a resync is due).
        """
        rid, mine = self.replica_id, self.keys.replica_blocks(self.replica_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(mine)
        pipe.sscan(mine, cursor=cursor, count=count)
        size, (next_cursor, members) = await pipe.execute()
        if size != self.num_published:
            return 0, f"{mine} lists {size} blocks where {self.num_published} were published"
        if members:
            pipe = self.redis.pipeline(transaction=False)
            for block_hash in members:
                pipe.sismember(self.keys.block(block_hash), rid)
            lost = sum(not listed for listed in await pipe.execute())
            if lost:
                return 0, f"{lost} of {len(members)} block keys checked no longer list {rid}"
        return int(next_cursor), None

    async def remove(self) -> int:
        """Take this replica out of the index, heartbeat and registry; returns blocks removed."""
        old = sorted(await self.published())
        await self.apply((), old)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.replica_blocks(self.replica_id))
        pipe.delete(self.keys.heartbeat(self.replica_id))
        pipe.srem(self.keys.replicas, self.replica_id)
        await pipe.execute()
        self.num_published = 0
        return len(old)


async def reap_replica(redis: Any, keys: RedisKeys, replica_id: str) -> int:
    """Remove a dead replica's entries (the router's janitor); returns blocks removed."""
    return await IndexWriter(redis, keys, replica_id).remove()
