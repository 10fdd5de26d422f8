"""The router's fleet stats and /metrics follow the replicas' privacy rules (#15): a tenant key
sees its own tenant's counters and agents only (from the per-tenant agent counters replicas
write to Redis), the admin sees all, and /metrics needs the admin key unless opened."""

from __future__ import annotations

import json

import httpx
import pytest

from prefixgate.cache import KVCacheManager, TokenSequence, make_extra_keys
from prefixgate.gateway.scaleout.fleet_stats import queue_snapshot, snapshot_json
from prefixgate.gateway.scaleout.keys import RedisKeys
from tests.live_gateway import ADMIN_KEY, API_KEYS, KEY_ALPHA, KEY_BETA
from tests.scaleout.conftest import free_port, router_settings, running_router, wait_for

pytestmark = pytest.mark.slow


def two_tenant_stats():
    """A real manager's snapshot with alpha and beta traffic under distinctive agent labels."""
    m = KVCacheManager(32, 4, watermark=0)
    for seq, (tenant, agent) in enumerate(
        [("alpha", "alpha-spy-agent"), ("alpha", "alpha-spy-agent"), ("beta", "beta-bot")]
    ):
        tokens = list(range(12)) + [100 + seq]
        alloc = m.allocate(TokenSequence(seq, tokens, make_extra_keys("m", tenant), tenant, agent))
        m.prepare_write(seq, len(tokens) - alloc.num_cached_tokens)
        m.commit_computed(seq, len(tokens) - alloc.num_cached_tokens)
    return m.stats()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("public", [False, True])
def test_router_stats_are_tenant_private(redis_server, loaded_model, public):
    # A namespace of its own: the session's Redis also serves the other scale-out tests.
    namespace = f"privacy-{public}"
    keys = RedisKeys(namespace)
    pipe = redis_server.client().pipeline()
    queue_snapshot(pipe, keys, "replica-x", "1", snapshot_json("replica-x", two_tenant_stats()))
    pipe.execute()
    # No replica answers here: the counters come from Redis alone.
    settings = router_settings([f"http://127.0.0.1:{free_port()}"], redis_server.url,
                               api_keys=API_KEYS, admin_key=ADMIN_KEY, metrics_public=public,
                               namespace=namespace)
    with running_router(settings, loaded_model.tokenizer, loaded_model.name) as (url, _):
        def get(path: str, key: str | None = None) -> httpx.Response:
            return httpx.get(url + path, headers=bearer(key) if key else None, timeout=30)

        def from_redis() -> dict | None:
            answer = get("/v1/cache/stats", ADMIN_KEY).json()
            return answer if answer.get("source") == "redis" and answer["per_tenant"] else None

        admin = wait_for(from_redis, 30, "fleet counters from Redis")
        assert admin["scope"] == "admin" and {"alpha", "beta"} <= set(admin["per_tenant"])
        assert {"alpha-spy-agent", "beta-bot"} <= set(admin["per_agent"])
        assert "replica-x" in admin["per_replica"]
        assert admin["clients"] == {}  # counted over every tenant: the admin's to see

        beta = get("/v1/cache/stats", KEY_BETA).json()
        assert beta["scope"] == "tenant" and beta["tenant"] == "beta"
        assert "alpha" not in json.dumps(beta)
        assert set(beta["per_tenant"]) == {"beta"} and set(beta["per_agent"]) == {"beta-bot"}
        assert beta["global"] == beta["per_tenant"]["beta"] and "clients" not in beta
        alpha = get("/v1/cache/stats", KEY_ALPHA).json()
        assert set(alpha["per_agent"]) == {"alpha-spy-agent"} and "beta" not in alpha["per_tenant"]

        if public:
            assert get("/metrics").status_code == 200
        else:
            assert get("/metrics").status_code == 401
            denied = get("/metrics", KEY_ALPHA)
            assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_required"
            assert get("/metrics", ADMIN_KEY).status_code == 200
