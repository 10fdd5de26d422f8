"""The Responses and Messages surfaces behind the router, on the real fleet (two replicas, a real
redis-server): a conversation continued with ``previous_response_id`` lands on the replica that
holds its pages (its stored conversation, shared in Redis, is hashed for placement), stored
responses are readable through any replica, and Anthropic requests pass through."""

from __future__ import annotations

import httpx
import pytest

from prefixgate.gateway.router.proxy import REPLICA_HEADER
from tests.scaleout.conftest import reset_caches

pytestmark = pytest.mark.slow

SYSTEM = ("You are one of many research agents. Cite sources, keep answers short, and never "
          "invent facts. ") * 8


def test_previous_response_id_lands_on_the_replica_holding_the_conversation(fleet):
    """Each agent's first turn is served by a chosen replica (directly, alternating); its next
    turn goes through the router with only previous_response_id and a new item. Both replicas
    hold the shared instructions, so only the stored conversation (hashed by the router) tells
    them apart."""
    reset_caches([r.url for r in fleet.replicas])
    homes = {}
    for agent in range(4):
        replica = fleet.replicas[agent % 2]
        task = " ".join(f"item-{agent}-{i}" for i in range(24))  # >= 2 pages of its own
        first = httpx.post(replica.url + "/v1/responses", timeout=120, json={
            "instructions": SYSTEM, "temperature": 0, "max_output_tokens": 6,
            "input": f"Agent {agent}: sort these: {task}"})
        assert first.status_code == 200, first.text
        homes[agent] = (replica.replica_id, first.json())
    with httpx.Client(base_url=fleet.router_url, timeout=120) as client:
        for agent, (home, first) in homes.items():
            second = client.post("/v1/responses", json={
                "instructions": SYSTEM, "temperature": 0, "max_output_tokens": 4,
                "previous_response_id": first["id"], "input": "And in one word?"})
            assert second.status_code == 200, second.text
            assert second.headers[REPLICA_HEADER] == home, (agent, home)
            floor = first["usage"]["input_tokens"] // 16 * 16
            assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] >= floor
            # stored in Redis: any replica returns it, through the router too
            fetched = client.get(f"/v1/responses/{first['id']}")
            assert fetched.status_code == 200 and fetched.json()["id"] == first["id"]


def test_anthropic_messages_pass_through_the_router(fleet):
    with httpx.Client(base_url=fleet.router_url, timeout=120) as client:
        body = {"max_tokens": 4, "temperature": 0, "system": SYSTEM,
                "messages": [{"role": "user", "content": "Hello"}]}
        first = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        second = client.post("/v1/messages", json=body)
        assert first.status_code == second.status_code == 200, first.text
        assert second.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER]
        assert second.json()["usage"]["cache_read_input_tokens"] > 0
        counted = client.post("/v1/messages/count_tokens", json={
            "system": SYSTEM, "messages": body["messages"]})
        usage = first.json()["usage"]
        assert counted.json()["input_tokens"] == (usage["input_tokens"]
                                                 + usage["cache_read_input_tokens"]
                                                 + usage["cache_creation_input_tokens"])
