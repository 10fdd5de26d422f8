"""Tenant-private observability (#15): with auth on, a tenant key's /v1/cache/stats and dashboard
show its own tenant only (counters, agents, shared prefixes, never prompt text); the admin key
sees every tenant and the previews; --stats-previews off hides previews from everyone;
/metrics needs the admin key unless --metrics-public opens it."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from prefixgate.gateway.server import ServerSettings, create_app
from tests.gateway.conftest import ADMIN_KEY, API_KEYS, KEY_ALPHA, KEY_BETA, wait_idle
from tests.gateway.test_dashboard import chromium, load_page  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.contextmanager
def alpha_sharing(gateway, nonce: str, agent: str) -> Iterator[None]:
    """Two live alpha streams sharing a distinctive system prompt (a top shared prefix),
    labelled with a distinctive agent; held open while the caller looks at the stats."""
    system = f"ALPHASECRET {nonce} the launch codes are in the blue binder. " * 6
    body = {"model": gateway.model, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {**bearer(KEY_ALPHA), "X-Agent-Id": agent}
    with httpx.Client(base_url=gateway.auth_url, timeout=120) as c:

        def stream(task: str):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            return c.stream(
                "POST", "/v1/chat/completions", json={**body, "messages": messages},
                headers=headers,
            )

        with stream("One.") as first, stream("Two.") as second:
            # Keep the iterators alive: a collected one closes its response (a disconnect).
            lines = first.iter_lines(), second.iter_lines()
            assert all(next(it).startswith("data: ") for it in lines)
            yield
    with httpx.Client(base_url=gateway.auth_url, timeout=120) as admin:
        wait_idle(admin, headers=bearer(ADMIN_KEY))


def beta_request(gateway, agent: str) -> None:
    with httpx.Client(base_url=gateway.auth_url, timeout=120) as c:
        body = {"model": gateway.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Beta says hello."}]}
        answer = c.post("/v1/chat/completions", json=body,
                        headers={**bearer(KEY_BETA), "X-Agent-Id": agent})
        assert answer.status_code == 200, answer.text


def stats(url: str, key: str) -> dict:
    answer = httpx.get(url + "/v1/cache/stats", headers=bearer(key), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_tenant_sees_only_itself_and_the_admin_sees_all(gateway):
    nonce = uuid.uuid4().hex[:10]
    alpha_agent, beta_agent = f"alpha-spy-{nonce}", f"beta-bot-{nonce}"
    beta_request(gateway, beta_agent)
    with alpha_sharing(gateway, nonce, alpha_agent):
        beta, alpha = stats(gateway.auth_url, KEY_BETA), stats(gateway.auth_url, KEY_ALPHA)
        admin = stats(gateway.auth_url, ADMIN_KEY)

    text = json.dumps(beta).lower()
    for secret in ("alpha", nonce.lower(), "secret", "launch codes", "binder"):
        assert secret not in text.replace(beta_agent.lower(), ""), secret
    assert beta["scope"] == "tenant" and beta["tenant"] == "beta"
    assert set(beta["per_tenant"]) == {"beta"} and beta_agent in beta["per_agent"]
    assert beta["global"] == beta["per_tenant"]["beta"]  # its own total, not the server's
    assert beta["top_prefixes"] == []  # alpha's shared prefix is not beta's

    assert alpha["scope"] == "tenant" and set(alpha["per_tenant"]) == {"alpha"}
    assert alpha_agent in alpha["per_agent"] and beta_agent not in alpha["per_agent"]
    ours = [p for p in alpha["top_prefixes"] if p["num_sharers"] >= 2]
    assert ours, alpha["top_prefixes"]
    assert all("text" not in p for p in alpha["top_prefixes"])  # previews: the admin's only
    assert "ALPHASECRET" not in json.dumps(alpha)

    assert admin["scope"] == "admin"
    assert {"alpha", "beta"} <= set(admin["per_tenant"])
    assert {alpha_agent, beta_agent} <= set(admin["per_agent"])
    assert any(nonce in p.get("text", "") for p in admin["top_prefixes"]), admin["top_prefixes"]
    assert admin["global"]["requests"] >= sum(
        admin["per_tenant"][t]["requests"] for t in ("alpha", "beta")
    )


def test_beta_dashboard_shows_nothing_of_alpha(chromium, gateway, tmp_path):  # noqa: F811
    nonce = uuid.uuid4().hex[:10]
    alpha_agent, beta_agent = f"alpha-spy-{nonce}", f"beta-bot-{nonce}"
    beta_request(gateway, beta_agent)
    with alpha_sharing(gateway, nonce, alpha_agent):
        beta = load_page(chromium, f"{gateway.auth_url}/dashboard?key={KEY_BETA}", tmp_path / "b")
        admin = load_page(
            chromium, f"{gateway.auth_url}/dashboard?key={ADMIN_KEY}", tmp_path / "a"
        )
    shown = beta.dom.text
    assert beta.dom.one("status").attrs["data-state"] == "live"
    assert beta_agent in shown
    for secret in (alpha_agent, "alpha", "ALPHASECRET", "launch codes"):
        assert secret not in shown, secret
    everything = admin.dom.text
    assert alpha_agent in everything and beta_agent in everything and "ALPHASECRET" in everything


def test_metrics_need_the_admin_key(gateway):
    with httpx.Client(base_url=gateway.auth_url, timeout=60) as c:
        missing = c.get("/metrics")
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        tenant = c.get("/metrics", headers=bearer(KEY_ALPHA))
        assert tenant.status_code == 403
        assert tenant.json()["error"]["code"] == "admin_required"
        admin = c.get("/metrics", headers=bearer(ADMIN_KEY))
        assert admin.status_code == 200 and "prefixgate:prefix_cache_queries" in admin.text
    # auth off: open, as before
    assert httpx.get(gateway.open_url + "/metrics", timeout=60).status_code == 200


def test_previews_off_and_public_metrics(gateway, engine):
    """A second app over the same running engine, with --stats-previews off and
    --metrics-public on (the lifespan leaves the engine alone)."""
    settings = ServerSettings(
        api_keys=API_KEYS, admin_key=ADMIN_KEY, stats_previews=False, metrics_public=True
    )
    nonce = uuid.uuid4().hex[:10]
    with TestClient(create_app(engine, settings, manage_engine=False)) as other:
        with alpha_sharing(gateway, nonce, f"alpha-{nonce}"):
            admin = other.get("/v1/cache/stats", headers=bearer(ADMIN_KEY)).json()
            with_previews = stats(gateway.auth_url, ADMIN_KEY)
        assert any(nonce in p.get("text", "") for p in with_previews["top_prefixes"])
        assert admin["top_prefixes"], admin  # the prefixes are listed, their text is not
        assert all("text" not in p for p in admin["top_prefixes"])
        assert "ALPHASECRET" not in json.dumps(admin)
        public = other.get("/metrics")
        assert public.status_code == 200 and "prefixgate:prefix_cache_queries" in public.text
        assert other.get("/v1/cache/stats").status_code == 401  # only /metrics was opened
