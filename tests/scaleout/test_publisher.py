"""Replica side: the index in Redis mirrors the engine's cache, heartbeats and fleet stats are
published, and a replica without Redis keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from prefixgate.cache.events import BlockRemoved, BlockStored
from prefixgate.cache.hashing import BlockHasher, make_extra_keys
from prefixgate.engine.api import GenerationRequest, SamplingParams
from prefixgate.gateway.scaleout.event_buffer import EventBuffer
from prefixgate.gateway.scaleout.fleet_stats import read_fleet_stats
from prefixgate.gateway.scaleout.heartbeat import Heartbeat
from prefixgate.gateway.scaleout.index_writer import AUDIT_BLOCKS, IndexWriter, coalesce
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.publisher import PublisherConfig, ReplicaPublisher
from prefixgate.gateway.scaleout.redis_client import connect
from tests.scaleout.conftest import (
    HEARTBEAT_TTL_S,
    NUM_PAGES,
    PAGE_SIZE,
    free_port,
    index_mismatch,
    wait_for,
)

pytestmark = pytest.mark.slow
KEYS = RedisKeys()


def published(redis, replica_id: str) -> set[bytes]:
    return set(redis.smembers(KEYS.replica_blocks(replica_id)))


def chat(url: str, system: str, max_tokens: int = 2, **extra) -> dict:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Reply with one word."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return body


def test_the_index_mirrors_the_engine_cache_and_hashes_like_the_router(fleet):
    replica = fleet.replicas[0]
    redis = fleet.redis.client()
    body = chat(replica.url, "You index every block you compute. " * 12)
    wait_for(lambda: not index_mismatch(redis, replica), 30, "the index to mirror the engine",
             explain=lambda: index_mismatch(redis, replica))
    # The prompt's chain, hashed independently of the engine (tokens from the replica's own
    # /tokenize, the model id and tenant the router uses), is in Redis block by block.
    tokens = httpx.post(replica.url + "/tokenize", json={"messages": body["messages"]},
                        timeout=30).json()["tokens"]
    hasher = BlockHasher(PAGE_SIZE, seed=0)
    chain = [b.block_hash for b in hasher.hash_blocks(tokens, make_extra_keys(fleet.model_id,
                                                                               "default"))]
    assert len(chain) == len(tokens) // PAGE_SIZE > 3
    for block_hash in chain:
        assert redis.sismember(KEYS.block(block_hash), replica.replica_id)
    # The other replica never saw this prompt.
    other = fleet.replicas[1].replica_id
    assert not any(redis.sismember(KEYS.block(h), other) for h in chain)
    redis.close()


def test_reset_unpublishes_what_the_cache_dropped(fleet):
    replica = fleet.replicas[1]
    redis = fleet.redis.client()
    chat(replica.url, "Blocks that will be dropped again. " * 10)
    wait_for(lambda: len(published(redis, replica.replica_id)) > 3, 30, "blocks to be published")
    httpx.post(replica.url + "/v1/cache/reset", timeout=30).raise_for_status()
    wait_for(lambda: not index_mismatch(redis, replica), 30, "BlockRemoved to reach Redis",
             explain=lambda: index_mismatch(redis, replica))
    assert set(replica.engine.cached_block_hashes()) == set()  # nothing pinned or in use
    redis.close()


def test_heartbeat_carries_load_and_hashing_facts_and_expires(fleet):
    redis = fleet.redis.client()
    replica = fleet.replicas[0]
    raw = wait_for(lambda: redis.get(KEYS.heartbeat(replica.replica_id)), 10, "a heartbeat")
    beat = Heartbeat.from_json(raw)
    assert beat.replica_id == replica.replica_id
    assert beat.url == replica.url
    assert beat.model_id == fleet.model_id
    assert (beat.page_size, beat.hash_seed, beat.num_pages) == (PAGE_SIZE, 0, NUM_PAGES)
    assert 0 <= beat.pages_free <= beat.num_pages
    assert (beat.kv_tier, beat.tier_discount) == ("", None)  # this fleet runs without a tier
    assert 0 < redis.pttl(KEYS.heartbeat(replica.replica_id)) <= HEARTBEAT_TTL_S * 1000
    assert replica.replica_id.encode() in redis.smembers(KEYS.replicas)
    redis.close()
    with pytest.raises(ValueError, match="lacks"):
        Heartbeat.from_json(b'{"replica_id": "x"}')
    with pytest.raises(ValueError, match="not JSON"):
        Heartbeat.from_json(b"{")
    # a beat from a replica older than the tier fields still reads, as "no tier"
    old = json.loads(raw)
    del old["kv_tier"], old["tier_discount"]
    assert Heartbeat.from_json(json.dumps(old)).kv_tier == ""


def test_fleet_stats_in_redis_match_the_engine_counters(fleet):
    replica = fleet.replicas[0]
    chat(replica.url, "Count me in the fleet statistics. " * 6, user="stats-agent")

    async def read():
        redis = connect(fleet.redis.url)
        try:
            return await read_fleet_stats(redis, KEYS)
        finally:
            await redis.aclose()

    def caught_up():
        stats = asyncio.run(read())
        return stats if stats.per_replica.get(replica.replica_id) == (
            replica.engine.cache_stats().total) else None

    stats = wait_for(caught_up, 30, "the replica's counters in Redis")
    engine = replica.engine.cache_stats()
    assert stats.per_agent["stats-agent"] == engine.per_agent["stats-agent"]
    # Tenant sums include this replica's share (plus whatever the others reported).
    assert stats.per_tenant["default"].query_tokens >= engine.per_tenant["default"].query_tokens
    assert stats.total.query_tokens >= engine.total.query_tokens


def test_event_buffer_never_blocks_and_coalesces():
    buffer = EventBuffer(max_events=3)
    for i in range(5):
        buffer(BlockStored(bytes([i]) * 16, b"\0" * 16, 16))
    assert len(buffer) == 3 and buffer.overflowed
    buffer.discard()
    assert len(buffer) == 0 and not buffer.overflowed
    h1, h2 = b"1" * 16, b"2" * 16
    stored, removed = coalesce([BlockStored(h1, b"", 16), BlockStored(h2, b"", 16),
                                BlockRemoved(h1), BlockRemoved(h2), BlockStored(h2, b"", 16)])
    assert (stored, removed) == ([h2], [h1])
    buffer.close()
    buffer(BlockStored(h1, b"", 16))
    assert len(buffer) == 0
    with pytest.raises(ValueError, match="max_events"):
        EventBuffer(0)


def test_bad_publisher_settings_fail_early():
    with pytest.raises(ValueError, match="redis-url"):
        PublisherConfig("http://x", "r1", "http://a:1")
    with pytest.raises(ValueError, match="replica id"):
        PublisherConfig("redis://x", "has space", "http://a:1")
    with pytest.raises(ValueError, match="advertise-url"):
        PublisherConfig("redis://x", "r1", "a:1")


def test_a_replica_without_redis_keeps_serving(fleet):
    engine = fleet.replicas[1].engine
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    config = PublisherConfig(dead, "lonely", "http://127.0.0.1:1", heartbeat_ttl_s=0.3,
                             redis_timeout_s=0.2)

    async def main() -> int:
        publisher = ReplicaPublisher(engine, config, served_model="m")
        await publisher.start()
        request = GenerationRequest(tuple(range(100, 180)), SamplingParams(max_tokens=2,
                                    temperature=0), tenant="default", request_id="no-redis")
        deltas = await engine.complete(request)
        await asyncio.sleep(0.5)
        status = publisher.status
        await publisher.stop(timeout_s=0.5)  # gives up on Redis instead of failing shutdown
        assert not status.connected and status.failures >= 1 and status.resyncs == 0
        assert status.last_error
        return len(deltas)

    assert asyncio.run(main()) >= 1


def test_a_redis_that_may_evict_the_index_is_named_in_a_warning(fleet, own_redis, caplog):
    """Under allkeys-lru Redis evicts index keys silently (the index has no TTL): the replica
    says so once at its first resync; the default noeviction and volatile-* say nothing."""
    engine = fleet.replicas[1].engine

    async def publish(policy: str) -> list[str]:
        client = own_redis.client()
        client.config_set("maxmemory-policy", policy)
        client.close()
        caplog.clear()
        publisher = ReplicaPublisher(engine, PublisherConfig(own_redis.url, "policy-check",
                                                             "http://127.0.0.1:1"), served_model="m")
        await publisher.start()
        deadline = asyncio.get_running_loop().time() + 30
        while publisher.status.resyncs == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        await publisher.stop()
        assert publisher.status.resyncs >= 1, publisher.status
        return [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="prefixgate.scaleout"):
        assert asyncio.run(publish("noeviction")) == []
        assert asyncio.run(publish("volatile-lru")) == []
        [warning] = asyncio.run(publish("allkeys-lru"))
    assert "allkeys-lru" in warning and "policy-check" in warning and "volatile-lru" in warning


def test_index_keys_dropped_behind_the_publishers_back_are_restored(fleet, own_redis):
    """An ``allkeys-*`` eviction or a manual DEL removes index keys while the replica stays
    registered: the heartbeat notices (its own set's size, a rotating check of the block keys)
    and the index is resynchronised within a few beats, each way it can be lost; a lost stats
    snapshot is written again."""
    replica = fleet.replicas[1]
    chat(replica.url, "Blocks Redis will lose behind the publisher's back. " * 8)
    engine = replica.engine
    config = PublisherConfig(own_redis.url, "heal-check", "http://127.0.0.1:1",
                             heartbeat_ttl_s=0.3)
    view = SimpleNamespace(replica_id="heal-check", engine=engine, publisher=None)
    client = own_redis.client()
    mine = KEYS.replica_blocks("heal-check")

    def block_keys() -> list[bytes]:
        return [KEYS.block(h) for h in client.smembers(mine)]

    losses = {
        "its own set": lambda: client.delete(mine),
        "every block key": lambda: client.delete(*block_keys()),
        "one block key": lambda: client.delete(block_keys()[0]),
        "both": lambda: client.delete(mine, *block_keys()),
    }

    async def main() -> None:
        publisher = ReplicaPublisher(engine, config, served_model="m")
        view.publisher = publisher
        await publisher.start()
        try:
            await wait_until(lambda: publisher.status.resyncs and not index_mismatch(client, view),
                             "the first resync", view)
            assert len(engine.cached_block_hashes()) > 3
            for what, lose in losses.items():
                lose()
                assert index_mismatch(client, view), what
                beats = publisher.status.beats
                # NOTE: bounded in beats, not seconds: the engine threads load this machine
                await wait_until(lambda beats=beats: not index_mismatch(client, view)
                                 or publisher.status.beats > beats + 3, what, view)
                assert not index_mismatch(client, view), (what, index_mismatch(client, view))
            assert publisher.status.index_repairs == len(losses)
            # a lost stats snapshot is written again (it changes only with traffic)
            [snapshot] = client.smembers(KEYS.stats_index)
            client.delete(snapshot, KEYS.stats_index)
            beats = publisher.status.beats
            await wait_until(lambda: client.exists(snapshot) and client.smembers(KEYS.stats_index)
                             or publisher.status.beats > beats + 3, "the stats snapshot", view)
            assert client.exists(snapshot) and client.smembers(KEYS.stats_index) == {snapshot}
        finally:
            await publisher.stop()

    asyncio.run(main())
    client.close()


async def wait_until(predicate, what: str, view, timeout_s: float = 60) -> None:
    """Poll ``predicate`` (blocking Redis reads: on a worker thread) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(predicate):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {view.publisher.status}")
        await asyncio.sleep(0.02)


def test_the_audit_checks_every_block_key_within_a_bounded_number_of_beats(redis_server):
    """A lost block key in an index bigger than one beat's slice is found within a full pass
    of the rotating check (about blocks / AUDIT_BLOCKS beats), wherever it sits."""
    keys = RedisKeys("audit-test")
    held = [i.to_bytes(16, "big") for i in range(5 * AUDIT_BLOCKS)]

    async def main() -> None:
        redis = connect(redis_server.url)
        writer = IndexWriter(redis, keys, "r1")
        try:
            await writer.resync(held)
            assert writer.num_published == len(held)
            cursor, passes = 0, 0
            while True:  # an intact index: one full pass, nothing missing
                cursor, lost = await writer.audit(cursor)
                assert lost is None
                passes += 1
                if cursor == 0:
                    break
            assert passes <= 2 * len(held) // AUDIT_BLOCKS
            await redis.delete(keys.block(held[-7]))
            found, beats = None, 0
            while found is None and beats < 2 * passes:
                cursor, found = await writer.audit(cursor)
                beats += 1
            assert found and "1 of" in found, (beats, found)
            await writer.resync(held)  # what the publisher does next
            await writer.apply([], held[:10])  # deltas keep the expected size exact
            await writer.apply(held[:3], [])
            assert writer.num_published == len(held) - 7
            assert (await writer.audit(0))[1] is None
            await redis.srem(keys.replica_blocks("r1"), held[20])
            _, shrunk = await writer.audit(0)
            assert shrunk and f"lists {len(held) - 8} blocks" in shrunk
        finally:
            await writer.remove()
            await redis.aclose()

    asyncio.run(main())
