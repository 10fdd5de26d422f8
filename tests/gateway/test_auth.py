"""API keys → tenants: isolation of cached pages, admin-only cache endpoints."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.gateway.conftest import ADMIN_KEY, KEY_ALPHA, KEY_BETA, KEY_PLAIN

pytestmark = pytest.mark.slow


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.auth_url + "/v1", api_key=key, max_retries=0)


def shared_prompt() -> list[dict]:
    nonce = uuid.uuid4().hex[:12]
    system = f"[{nonce}] " + "You are a meticulous release manager. " * 20
    return [{"role": "system", "content": system}, {"role": "user", "content": "Status?"}]


def cached(result) -> int:
    return result.usage.prompt_tokens_details.cached_tokens


def test_same_prompt_two_tenants_share_nothing(gateway):
    messages = shared_prompt()
    alpha, beta = sdk(gateway, KEY_ALPHA), sdk(gateway, KEY_BETA)
    first = alpha.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    assert cached(first) == 0
    other_tenant = beta.chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=2
    )
    assert cached(other_tenant) == 0
    # The same prompt again in each tenant hits its own pages: isolation, not a cold cache.
    assert (
        cached(alpha.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2))
        > 0
    )
    assert (
        cached(beta.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2))
        > 0
    )


def test_cache_salt_isolates_within_a_tenant(gateway):
    messages = shared_prompt()
    alpha = sdk(gateway, KEY_ALPHA)
    alpha.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    salted = alpha.chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=2, extra_body={"cache_salt": "s1"}
    )
    assert cached(salted) == 0
    again = alpha.chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=2, extra_body={"cache_salt": "s1"}
    )
    assert cached(again) > 0


def test_plain_key_is_the_default_tenant(gateway):
    messages = shared_prompt()
    open_client = openai.OpenAI(base_url=gateway.open_url + "/v1", api_key="x", max_retries=0)
    open_client.chat.completions.create(model=gateway.model, messages=messages, max_tokens=2)
    # A bare key (no :TENANT) belongs to "default", the tenant of the open server.
    plain = sdk(gateway, KEY_PLAIN).chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=2
    )
    assert cached(plain) > 0


def test_per_tenant_stats(gateway):
    alpha = sdk(gateway, KEY_ALPHA)
    alpha.chat.completions.create(model=gateway.model, messages=shared_prompt(), max_tokens=2)
    with httpx.Client(
        base_url=gateway.auth_url, headers={"Authorization": f"Bearer {KEY_ALPHA}"}
    ) as c:
        stats = c.get("/v1/cache/stats").json()
    assert stats["per_tenant"]["alpha"]["requests"] >= 1
    assert stats["per_tenant"]["alpha"]["query_tokens"] > 0


def test_admin_endpoints_need_the_admin_key(gateway):
    body = {"messages": [{"role": "system", "content": "pin me " * 40}]}
    with httpx.Client(base_url=gateway.auth_url) as c:
        assert c.post("/v1/cache/reset").status_code == 401
        tenant_key = {"Authorization": f"Bearer {KEY_ALPHA}"}
        for path in ("/v1/cache/pin", "/v1/cache/unpin"):
            denied = c.post(path, json=body, headers=tenant_key)
            assert denied.status_code == 403
            assert denied.json()["error"]["type"] == "permission_error"
        assert c.post("/v1/cache/reset", headers=tenant_key).status_code == 403
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        pinned = c.post("/v1/cache/pin", json={**body, "tenant": "alpha"}, headers=admin)
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["tenant"] == "alpha"
        unpinned = c.post("/v1/cache/unpin", json={**body, "tenant": "alpha"}, headers=admin)
        assert unpinned.status_code == 200
        reset = c.post("/v1/cache/reset", headers=admin)
        assert reset.status_code == 200
        assert reset.json()["num_pages_dropped"] >= 0
