"""/v1/cache/stats, pin/unpin/reset and /tokenize, /detokenize on the open server."""

from __future__ import annotations

import uuid

import pytest

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
