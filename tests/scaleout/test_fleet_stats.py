"""Fleet counters summed from the replicas' Redis snapshots keep every counter, retention hits
included, and still read snapshots written before those existed."""

from __future__ import annotations

import asyncio
import json

from prefixgate.cache import KVCacheManager, TokenSequence, make_extra_keys
from prefixgate.cache.stats import HitStats
from prefixgate.gateway.scaleout.fleet_stats import queue_snapshot, read_fleet_stats, snapshot_json
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.redis_client import connect


def _stats_with_a_retention_hit():
    m = KVCacheManager(16, 4, watermark=0)
    keys = make_extra_keys("m", "alpha")
    tokens = list(range(12)) + [99]
    for seq in ("turn1", "turn2"):
        alloc = m.allocate(TokenSequence(seq, tokens, keys, "alpha", "coder"))
        m.prepare_write(seq, len(tokens) - alloc.num_cached_tokens)
        m.commit_computed(seq, len(tokens) - alloc.num_cached_tokens)
        m.free(seq)
        m.retain(tokens, keys, 60.0, tenant="alpha")
    return m.stats()


def test_fleet_sums_keep_retention_counters(redis_server):
    stats = _stats_with_a_retention_hit()
    assert stats.total.retention_hits == 1
    keys = RedisKeys("fleet-sum-test")
    pipe = redis_server.client().pipeline()
    for replica in ("a", "b"):
        queue_snapshot(pipe, keys, replica, "1", snapshot_json(replica, stats))
    old = {"replica": "c", "total": [1, 10, 4], "tenant": {"alpha": [1, 10, 4]}, "agent": {}}
    queue_snapshot(pipe, keys, "c", "1", json.dumps(old).encode())  # written before retention
    pipe.execute()

    async def read():
        client = connect(redis_server.url)
        try:
            return await read_fleet_stats(client, keys)
        finally:
            await client.aclose()

    fleet = asyncio.run(read())
    alpha = stats.per_tenant["alpha"]
    assert fleet.per_tenant["alpha"] == alpha + alpha + HitStats(1, 10, 4)
    assert fleet.total.retention_hits == 2 and fleet.total.retention_hit_tokens == 2 * 12
    assert fleet.per_tenant_agent["alpha"]["coder"].retention_hits == 2
