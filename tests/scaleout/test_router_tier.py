"""The router scores the fleet's Redis KV tier: blocks the tier holds count, at the loading
replica's measured discount, for replicas whose heartbeat says they load from it (real Redis,
real RouterState placement; no model, the prompt's chain is given)."""

from __future__ import annotations

import asyncio
import time

import redis

from prefixgate.gateway.router.prompt import PromptKey
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.router.state import RouterState
from prefixgate.gateway.scaleout.heartbeat import Heartbeat
from prefixgate.gateway.scaleout.keys import RedisKeys

MODEL_ID = "tier-test-model"
A, B = "http://127.0.0.1:9101", "http://127.0.0.1:9102"


def beat(replica_id: str, url: str, **tier) -> bytes:
    return Heartbeat(replica_id=replica_id, url=url, model_id=MODEL_ID, served_model="m",
                     page_size=16, hash_seed=0, num_running=0, num_waiting=0, max_waiting=8,
                     num_pages=64, pages_free=64, auth_enabled=False, started_at=time.time(),
                     sent_at=time.time(), **tier).to_json()


def test_placement_follows_the_fleet_tier_at_the_measured_discount(redis_server):
    namespace = "router-tier-test"
    keys = RedisKeys(namespace)
    client = redis.Redis.from_url(redis_server.url)
    chain = tuple(i.to_bytes(16, "big") for i in range(300, 340))  # 40 blocks = 640 tokens
    key = PromptKey(chain, 40 * 16 + 5, session=None, tenant="default")

    async def place(state: RouterState) -> tuple[str, str, int, int]:
        await state.poll_heartbeats()
        replica, decision, matched, tier_tokens = await state.place(key, "salt")
        state.record("r", replica, decision.reason, matched, key, {}, tier_tokens)
        return replica.url, decision.reason, matched, tier_tokens

    async def main() -> None:
        settings = RouterSettings(replicas=(A, B), redis_url=redis_server.url,
                                  namespace=namespace, recent_route_ttl_s=0.0)
        state = RouterState(settings, None, MODEL_ID)
        try:
            # A holds the first 10 blocks in its pool; the tier holds all 40 (B evicted them)
            client.sadd(keys.replicas, "a", "b")
            for h in chain[:10]:
                client.sadd(keys.block(h), "a")
            for h in chain:
                client.set(keys.tier_entry(h), b"entry")
            # B loads from the tier but has not measured it: the prior (0.5) scores its 40
            # tier blocks as 20 cached ones, A's 10 pool blocks + 30 in the tier it cannot load
            # as 10: B wins
            client.set(keys.heartbeat("a"), beat("a", A))
            client.set(keys.heartbeat("b"), beat("b", B, kv_tier="redis"))
            assert await place(state) == (B, "prefix", 0, 640)
            # B measured loading as costly (discount 0.2: 8 blocks' worth): A's pool wins
            client.set(keys.heartbeat("b"), beat("b", B, kv_tier="redis", tier_discount=0.2))
            assert await place(state) == (A, "prefix", 160, 0)
            # both load from the tier at 0.9: A scores 10 + 0.9 * 30 = 37 blocks, B 0.9 * 40 = 36;
            # one block apart is beyond the match tolerance (2% of 645 tokens): A, by prefix
            client.set(keys.heartbeat("a"), beat("a", A, kv_tier="redis", tier_discount=0.9))
            client.set(keys.heartbeat("b"), beat("b", B, kv_tier="redis", tier_discount=0.9))
            assert await place(state) == (A, "prefix", 160, 480)
            # a private host tier is invisible to the router: no tier score
            client.set(keys.heartbeat("b"), beat("b", B, kv_tier="host", tier_discount=0.9))
            client.set(keys.heartbeat("a"), beat("a", A))
            assert await place(state) == (A, "prefix", 160, 0)
            # --tier-discount 0 turns the tier off, measured figures included
            off = RouterState(RouterSettings(replicas=(A, B), redis_url=redis_server.url,
                                             namespace=namespace, tier_discount=0.0), None, MODEL_ID)
            client.set(keys.heartbeat("b"), beat("b", B, kv_tier="redis", tier_discount=1.0))
            try:
                assert await place(off) == (A, "prefix", 160, 0)
            finally:
                await off.index.close()
            assert state.metrics.tier_tokens.labels("b")._value.get() == 640
        finally:
            await state.index.close()
            client.delete(*client.keys(namespace + ":*"))
            client.close()

    asyncio.run(main())
