"""/v1/cache/stats, pin/unpin/reset and /tokenize, /detokenize on the open server; retention
stats per tenant on the auth server."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, KEY_ALPHA, KEY_BETA, wait_idle

pytestmark = pytest.mark.slow


def system_prompt() -> str:
    return f"[{uuid.uuid4().hex[:12]}] " + "You triage bug reports for a compiler team. " * 12


def chat(
    client, gateway, messages, agent: str | None = None, user: str | None = None, max_tokens=2
):
    headers = {"X-Agent-Id": agent} if agent else {}
    body = {"model": gateway.model, "messages": messages, "max_tokens": max_tokens}
    if user:
        body["user"] = user
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_stats_shape_and_partition(client, gateway):
    chat(client, gateway, [{"role": "user", "content": "hi"}])
    stats = client.get("/v1/cache/stats").json()
    for key in ("global", "per_tenant", "per_agent", "top_prefixes", "engine"):
        assert key in stats
    assert (
        stats["pages_used"] + stats["pages_cached_free"] + stats["pages_free"] == stats["num_pages"]
    )
    assert 0 <= stats["pages_pinned"] <= stats["pages_used"]
    assert stats["page_size"] == gateway.page_size
    g = stats["global"]
    assert g["query_tokens"] >= g["hit_tokens"] >= 0 and g["tokens_saved"] == g["hit_tokens"]
    assert 0.0 <= g["hit_rate"] <= 1.0
    assert stats["engine"]["kernel_backend"] in ("torch", "triton")
    assert stats["engine"]["device"]
    # the precision it computes in (docs/precision.md): the exact fp32 default on CPU
    assert (stats["engine"]["dtype"], stats["engine"]["kv_dtype"]) == ("float32", "float32")


def test_agent_stats_from_header_and_user(client, gateway):
    system = system_prompt()
    header_agent = f"planner-{uuid.uuid4().hex[:6]}"
    user_agent = f"coder-{uuid.uuid4().hex[:6]}"
    chat(
        client,
        gateway,
        [{"role": "system", "content": system}, {"role": "user", "content": "a"}],
        agent=header_agent,
    )
    chat(
        client,
        gateway,
        [{"role": "system", "content": system}, {"role": "user", "content": "b"}],
        agent=header_agent,
    )
    chat(
        client,
        gateway,
        [{"role": "system", "content": system}, {"role": "user", "content": "c"}],
        user=user_agent,
    )
    agents = client.get("/v1/cache/stats").json()["per_agent"]
    assert agents[header_agent]["requests"] == 2
    assert agents[header_agent]["hit_tokens"] > 0  # its second request reused the first's pages
    assert agents[user_agent]["requests"] == 1
    assert agents[user_agent]["hit_tokens"] > 0  # and the third reused them across agents


def test_top_shared_prefixes_are_decoded(client, gateway):
    """Two streams sharing a system prompt, stats read while both are alive (they ask for far
    more tokens than they read; leaving the ``with`` block disconnects, which aborts them)."""
    system = system_prompt()
    body = {
        "model": gateway.model,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **body,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "one"},
                ],
            },
        ) as first,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **body,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "two"},
                ],
            },
        ) as second,
    ):
        # Both responses have started: both sequences hold their pages now. (Keep the line
        # iterators alive: a collected httpx iterator closes its response, i.e. disconnects.)
        first_lines, second_lines = first.iter_lines(), second.iter_lines()
        assert next(first_lines).startswith("data: ") and next(second_lines).startswith("data: ")
        prefixes = client.get("/v1/cache/stats").json()["top_prefixes"]
    shared = [p for p in prefixes if p["num_sharers"] >= 2]
    assert shared, prefixes
    assert any(system.split()[1] in p["text"] or system[:10] in p["text"] for p in shared)
    assert all(p["num_tokens"] % gateway.page_size == 0 for p in shared)


def test_tokenize_and_detokenize_round_trip(client, gateway):
    text = "Paged attention keeps the KV cache in fixed-size pages."
    tokenized = client.post("/tokenize", json={"prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == gateway.max_model_len
    back = client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert back["prompt"].strip() == text
    messages = [{"role": "user", "content": text}]
    chat_tokens = client.post("/tokenize", json={"messages": messages}).json()
    without_prompt = client.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert chat_tokens["count"] > without_prompt["count"]
    assert chat_tokens["tokens"][: without_prompt["count"]] == without_prompt["tokens"]
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "a", "messages": messages}).status_code == 400


def test_pin_survives_reset_and_unpin_releases(client, gateway):
    system = system_prompt()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "warm"}]
    chat(client, gateway, messages)  # compute the prefix once so its pages are cached
    pin_body = {"messages": [{"role": "system", "content": system}]}
    pinned = client.post("/v1/cache/pin", json=pin_body).json()
    try:
        assert pinned["num_pages"] >= 1 and pinned["num_tokens"] >= gateway.page_size
        assert client.get("/v1/cache/stats").json()["pages_pinned"] >= pinned["num_pages"]
        client.post("/v1/cache/reset")
        again = chat(
            client,
            gateway,
            [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
        )
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= pinned["num_tokens"]
    finally:
        unpinned = client.post("/v1/cache/unpin", json=pin_body).json()
    assert unpinned["num_pages"] == pinned["num_pages"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
            "required": ["city"],
        },
    },
}


def test_retention_stats_are_scoped_to_the_tenant(gateway):
    """An alpha agent ends a turn in a tool call, then comes back: alpha sees its retained pages,
    its retention hit and its learned pause; beta sees none of it; the admin sees it all."""
    nonce = uuid.uuid4().hex[:8]
    scout = f"scout-{nonce}"
    ask = [{"role": "user", "content": f"[{nonce}] What is the weather in Paris right now?"}]
    alpha_headers = {"Authorization": f"Bearer {KEY_ALPHA}", "X-Agent-Id": scout}
    body = {"model": gateway.model, "tools": [WEATHER_TOOL], "temperature": 0}

    def stats(key: str) -> dict:
        answer = httpx.get(gateway.auth_url + "/v1/cache/stats",
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    with httpx.Client(base_url=gateway.auth_url, timeout=120, headers=alpha_headers) as alpha:
        first = alpha.post("/v1/chat/completions", json={
            **body, "messages": ask, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 80}).json()
        assert first["choices"][0]["finish_reason"] == "tool_calls", first
        deadline = time.monotonic() + 10  # retention runs in the background after the response
        while not stats(KEY_ALPHA)["retained_per_tenant"] and time.monotonic() < deadline:
            time.sleep(0.05)
        message = first["choices"][0]["message"]
        call = message["tool_calls"][0]
        back = [*ask, {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
                {"role": "tool", "tool_call_id": call["id"], "content": "18 C, light rain"}]
        again = alpha.post("/v1/chat/completions", json={**body, "messages": back, "max_tokens": 1})
        assert again.status_code == 200, again.text
        wait_idle(alpha)

    alpha_view, beta_view, admin_view = stats(KEY_ALPHA), stats(KEY_BETA), stats(ADMIN_KEY)
    mine = alpha_view["per_agent"][scout]
    assert mine["retention_hits"] == 1 and 0 < mine["retention_hit_tokens"] <= mine["hit_tokens"]
    assert alpha_view["global"]["retention_hit_tokens"] >= mine["retention_hit_tokens"]
    assert set(alpha_view["retained_per_tenant"]) == {"alpha"}
    learned = alpha_view["retention_policy"]
    assert set(learned["agents"]) == {"alpha"}
    assert learned["agents"]["alpha"][scout]["pauses"] == 1  # the return ended its pause
    assert learned["agents"]["alpha"][scout]["source"] == "prior"  # 1 pause < 8
    assert learned["prior_s"] == 30.0 and learned["learn"] is True

    assert "alpha" not in beta_view["retained_per_tenant"]
    assert "alpha" not in beta_view["retention_policy"]["agents"]
    assert nonce not in json.dumps(beta_view)

    assert admin_view["retained_per_tenant"]["alpha"] >= 1
    assert scout in admin_view["retention_policy"]["agents"]["alpha"]
    assert admin_view["per_agent"][scout]["retention_hit_tokens"] == mine["retention_hit_tokens"]
