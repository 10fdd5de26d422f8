"""The router's ``/v1/cache/stats`` sums what each replica counted of its clients' requests
(the ``clients`` counters: hosted tools dropped, attribution lines removed, ...), from the
replicas' Redis snapshots and, without Redis, from the replicas themselves."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from prefixgate.gateway.scaleout.fleet_stats import queue_snapshot, read_fleet_stats, snapshot_json
from prefixgate.gateway.scaleout.keys import RedisKeys
from prefixgate.gateway.scaleout.redis_client import connect
from tests.scaleout.conftest import router_settings, running_router, wait_for

pytestmark = pytest.mark.slow


def drop_a_hosted_tool(url: str) -> None:
    """A Responses request with a hosted tool: the replica drops it and counts it."""
    response = httpx.post(url + "/v1/responses", timeout=120, json={
        "input": "Say hi.", "max_output_tokens": 2, "temperature": 0,
        "tools": [{"type": "web_search"}]})
    response.raise_for_status()
    assert response.headers["x-prefixgate-dropped-tools"] == "web_search"


def replica_clients(urls: list[str]) -> list[dict[str, int]]:
    return [httpx.get(url + "/v1/cache/stats", timeout=30).json()["clients"] for url in urls]


def summed(counters: list[dict[str, int]]) -> dict[str, int]:
    return {name: sum(c[name] for c in counters) for name in counters[0]}


def test_router_stats_sum_the_replicas_client_counters(fleet):
    urls = [r.url for r in fleet.replicas]
    for url in (urls[0], urls[1], urls[1]):
        drop_a_hosted_tool(url)
    expected = summed(replica_clients(urls))
    assert expected["hosted_tools_dropped"] >= 3

    def from_redis() -> dict | None:
        stats = httpx.get(fleet.router_url + "/v1/cache/stats", timeout=30).json()
        return stats if stats.get("clients") == expected else None

    # the publishers write the counters with their next beat
    stats = wait_for(from_redis, 30, "the replicas' client counters summed at the router",
                     explain=lambda: str(httpx.get(fleet.router_url + "/v1/cache/stats",
                                                   timeout=30).json().get("clients")))
    assert stats["source"] == "redis"
    # without Redis the router asks the replicas and sums their answers
    with running_router(router_settings(urls, None), fleet.tokenizer, fleet.model_id) as (url, app):
        wait_for(lambda: all(r.reachable for r in app.state.router.fleet), 10, "probes")
        stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()
    assert stats["source"] == "replicas" and stats["clients"] == expected


def test_client_counters_in_redis_are_summed_and_old_snapshots_still_read(redis_server):
    keys = RedisKeys("clients-sum-test")
    cache = fleet_cache_stats()
    pipe = redis_server.client().pipeline()
    queue_snapshot(pipe, keys, "a", "1", snapshot_json("a", cache, {"hosted_tools_dropped": 2,
                                                                    "max_tokens_clamped": 1}))
    queue_snapshot(pipe, keys, "b", "1", snapshot_json("b", cache, {"hosted_tools_dropped": 5}))
    queue_snapshot(pipe, keys, "c", "1", snapshot_json("c", cache))  # before clients counters
    pipe.execute()

    async def read():
        client = connect(redis_server.url)
        try:
            return await read_fleet_stats(client, keys)
        finally:
            await client.aclose()

    fleet = asyncio.run(read())
    assert fleet.clients == {"hosted_tools_dropped": 7, "max_tokens_clamped": 1}


def fleet_cache_stats():
    from prefixgate.cache import KVCacheManager

    return KVCacheManager(8, 4, watermark=0).stats()
