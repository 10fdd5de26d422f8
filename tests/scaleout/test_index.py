"""The Redis index on its own (no model): writer deltas/resync/removal, the router's chain
walk, and what each side does when Redis is unreachable."""

from __future__ import annotations

import asyncio

from prefixgate.gateway.router.index import IndexReader
from prefixgate.gateway.scaleout.index_writer import IndexWriter
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.redis_client import connect
from tests.scaleout.conftest import free_port


def block(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_writer_applies_resyncs_and_removes(redis_server):
    keys = RedisKeys("writer-test")

    async def main() -> None:
        redis = connect(redis_server.url)
        writer = IndexWriter(redis, keys, "r1")
        await writer.apply([block(1), block(2), block(3)], [])
        await writer.apply([block(4)], [block(2)])
        assert await writer.published() == {block(1), block(3), block(4)}
        assert await redis.smembers(keys.block(block(1))) == {b"r1"}
        assert not await redis.exists(keys.block(block(2)))  # empty sets vanish
        # Another replica shares block 3; our resync must not touch its membership.
        await IndexWriter(redis, keys, "r2").apply([block(3)], [])
        added, removed = await writer.resync([block(3), block(5)])
        assert (added, removed) == (1, 2)
        assert await writer.published() == {block(3), block(5)}
        assert await redis.smembers(keys.block(block(3))) == {b"r1", b"r2"}
        assert not await redis.exists(keys.block(block(1)))
        assert b"r1" in await redis.smembers(keys.replicas)
        await writer.remove()
        assert await redis.smembers(keys.block(block(3))) == {b"r2"}
        assert not await redis.exists(keys.replica_blocks("r1"))
        assert b"r1" not in await redis.smembers(keys.replicas)
        await redis.aclose()

    asyncio.run(main())


def test_chain_walk_counts_leading_blocks_and_stops_at_the_first_miss(redis_server):
    keys = RedisKeys("walk-test")
    chain = [block(i) for i in range(100, 106)]

    async def main() -> None:
        redis = connect(redis_server.url)
        await IndexWriter(redis, keys, "r1").apply(chain[:4], [])
        await IndexWriter(redis, keys, "r2").apply(chain[:2] + chain[3:], [])  # gap at block 2
        await IndexWriter(redis, keys, "r4").apply(chain[1:], [])  # no first block: no prefix
        reader = IndexReader(redis_server.url, keys)
        counts = await reader.matched_blocks(chain, ["r1", "r2", "r3", "r4"])
        assert counts == {"r1": 4, "r2": 2, "r3": 0, "r4": 0}
        assert await reader.matched_blocks(chain, []) == {}
        assert await reader.matched_blocks([], ["r1"]) == {"r1": 0}
        await reader.close()
        await redis.aclose()

    asyncio.run(main())


def test_the_reader_reports_redis_down_and_recovers(redis_server):
    async def main() -> None:
        dead = IndexReader(f"redis://127.0.0.1:{free_port()}/0", RedisKeys("x"), timeout_s=0.2)
        assert await dead.matched_blocks([block(1)], ["r1"]) is None
        assert dead.up is False and dead.failures == 1
        assert await dead.heartbeats() is None
        await dead.close()
        live = IndexReader(redis_server.url, RedisKeys("x"))
        live.up = False  # as after an outage
        assert await live.heartbeats() == ({}, [])
        assert live.up is True
        await live.close()

    asyncio.run(main())


def test_lookup_reports_the_fleet_tier_run_after_each_replica_match(redis_server):
    keys = RedisKeys("tier-walk-test")
    chain = [block(i) for i in range(200, 210)]

    async def main() -> None:
        redis = connect(redis_server.url)
        await IndexWriter(redis, keys, "r1").apply(chain[:2], [])
        await IndexWriter(redis, keys, "r2").apply(chain[:5], [])
        # the tier holds blocks 1..7 (not 0, not 8): entries of a replica that evicted them
        for h in chain[1:8]:
            await redis.set(keys.tier_entry(h), b"entry")
        reader = IndexReader(redis_server.url, keys)
        found = await reader.lookup(chain, ["r1", "r2", "r3", "r4"], tier_ids=["r1", "r2", "r3"])
        assert found.pool == {"r1": 2, "r2": 5, "r3": 0, "r4": 0}
        # r1: blocks 2..7 loadable; r2: 5..7; r3 needs block 0 first, which the tier lacks;
        # r4 does not load from the tier at all
        assert found.tier == {"r1": 6, "r2": 3, "r3": 0, "r4": 0}
        # without tier replicas the tier keys are not even passed
        plain = await reader.lookup(chain, ["r1", "r2"])
        assert plain.pool == {"r1": 2, "r2": 5} and plain.tier == {"r1": 0, "r2": 0}
        await redis.set(keys.tier_entry(chain[0]), b"entry")
        again = await reader.lookup(chain, ["r3"], tier_ids=["r3"])
        assert again.tier == {"r3": 8}
        await reader.close()
        await redis.aclose()

    asyncio.run(main())
