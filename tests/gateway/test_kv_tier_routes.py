"""The host tier behind a live server: a session evicted by other traffic comes back from the
tier over HTTP (cached_tokens), the admin sees the tier's counters in /v1/cache/stats and
/metrics, a tenant key does not (the tier is shared by every tenant)."""

from __future__ import annotations

import httpx

from prefixgate.engine.config import EngineConfig
from prefixgate.gateway.server import ServerSettings
from tests.engine.test_engine import SYSTEM, TASKS
from tests.live_gateway import ADMIN_KEY, API_KEYS, KEY_ALPHA, live_servers


def _chat(client: httpx.Client, text: str, max_tokens: int) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_session_returns_from_the_host_tier_over_http(loaded_model):
    from prefixgate.engine.async_engine import build_engine

    engine = build_engine(EngineConfig(num_pages=24, page_size=16, watermark=0.0, kv_tier="host",
                                       kv_tier_size_gb=0.05), loaded=loaded_model)
    engine.core.tier.load_timeout_s = 30.0  # a loaded CI box: hits, not the late fallback
    settings = ServerSettings(host="127.0.0.1", port=0, api_keys=API_KEYS, admin_key=ADMIN_KEY,
                              log_level="warning")
    with live_servers(engine, [settings]) as (server,):
        alpha = httpx.Client(base_url=server.base_url, timeout=120,
                             headers={"Authorization": f"Bearer {KEY_ALPHA}"})
        admin = httpx.Client(base_url=server.base_url, timeout=60,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        session = SYSTEM + " Plan the release checklist, step by step."
        first = _chat(alpha, session, 4)
        for i in range(3):  # other agents' traffic evicts the session's pages into the tier
            _chat(alpha, f"{i}: {TASKS[i]} " * 14, 1)
        engine.core.tier.flush()
        back = _chat(alpha, session, 4)
        assert back["choices"][0]["message"] == first["choices"][0]["message"]
        prompt = back["usage"]["prompt_tokens"]
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16

        tier = admin.get("/v1/cache/stats").json()["tier"]
        assert tier["tier"] == "host" and tier["hits"] >= 1 and tier["pages_loaded"] >= 1
        assert tier["pages_spilled"] >= tier["pages_loaded"] and tier["corrupt"] == 0
        assert tier["tokens_loaded"] == tier["pages_loaded"] * 16
        assert "tier" not in alpha.get("/v1/cache/stats").json()  # shared: admin only
        metrics = admin.get("/metrics").text
        assert "prefixgate:kv_tier_pages_loaded_total" in metrics
        assert "prefixgate:kv_tier_entries" in metrics
    engine.core.tier.close()
