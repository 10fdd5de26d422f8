"""The router hashes a request exactly as the replica that serves it will."""

from __future__ import annotations

import httpx
import pytest

from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.router.prompt import CHAT_PATH, COMPLETIONS_PATH, PromptHasher
from tests.scaleout.conftest import PAGE_SIZE

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "lookup_ticket", "description": "Fetch a support ticket by id.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                   "required": ["id"]}}}]
MESSAGES = [{"role": "developer", "content": "You triage tickets. " * 6},
            {"role": "user", "content": [{"type": "text", "text": "Ticket"},
                                         {"type": "text", "text": "T-1234 is stuck."}]}]


def engine_chain(engine, tokens: list[int], tenant: str, cache_salt: str | None = None):
    """The chain the engine itself computes when it schedules these tokens."""
    core = engine.core
    extra = core.extra_keys_for(tenant, cache_salt)
    return tuple(b.block_hash for b in core.scheduler.cache.hasher.hash_blocks(tokens, extra))


@pytest.fixture(scope="module")
def hasher(fleet):
    keys = KeyTable({"sk-alpha": "alpha", "sk-beta": "beta"}, admin_key="sk-admin")
    return PromptHasher(fleet.tokenizer, fleet.model_id, PAGE_SIZE, 0, keys)


def test_chat_with_tools_hashes_like_the_replica(fleet, hasher):
    replica = fleet.replicas[0]
    body = {"messages": MESSAGES, "tools": TOOLS, "cache_salt": "s1", "user": "agent-9"}
    tokens = httpx.post(replica.url + "/tokenize", json={"messages": MESSAGES, "tools": TOOLS},
                        timeout=30).json()["tokens"]
    key = hasher.key(CHAT_PATH, httpx.Request("POST", "/", json=body).content,
                     {"authorization": "Bearer sk-alpha"})
    assert key is not None
    assert key.num_tokens == len(tokens)
    assert key.chain == engine_chain(replica.engine, tokens, "alpha", "s1")
    assert len(key.chain) == len(tokens) // PAGE_SIZE
    assert (key.tenant, key.session) == ("alpha", "agent-9")
    # The agent header wins over `user`, as on the replica.
    key = hasher.key(CHAT_PATH, httpx.Request("POST", "/", json=body).content,
                     {"authorization": "Bearer sk-beta", "x-agent-id": "hdr"})
    assert key.session == "hdr" and key.chain == engine_chain(replica.engine, tokens, "beta",
                                                               "s1")
    # tool_choice "none" hides the tools from the template, on both sides.
    hidden = hasher.key(CHAT_PATH, httpx.Request(
        "POST", "/", json={**body, "tool_choice": "none"}).content,
        {"authorization": "Bearer sk-alpha"})
    plain = httpx.post(replica.url + "/tokenize", json={"messages": MESSAGES},
                       timeout=30).json()["tokens"]
    assert hidden.chain == engine_chain(replica.engine, plain, "alpha", "s1")


def test_completions_hash_text_and_token_prompts(fleet, hasher):
    engine = fleet.replicas[0].engine
    text = "Once upon a time " * 12
    tokens = httpx.post(fleet.replicas[0].url + "/tokenize", json={"prompt": text},
                        timeout=30).json()["tokens"]
    auth = {"authorization": "Bearer sk-admin"}  # the admin runs as the default tenant
    key = hasher.key(COMPLETIONS_PATH, httpx.Request("POST", "/", json={"prompt": text}).content,
                     auth)
    assert key.chain == engine_chain(engine, tokens, "default")
    ids = list(range(200, 300))
    key = hasher.key(COMPLETIONS_PATH, httpx.Request("POST", "/", json={"prompt": ids}).content,
                     auth)
    assert key.chain == engine_chain(engine, ids, "default") and key.num_tokens == 100


@pytest.mark.parametrize("body, headers", [
    (b'{"messages": []}', {"authorization": "Bearer sk-alpha"}),  # invalid: the replica says so
    (b"[1, 2]", {"authorization": "Bearer sk-alpha"}),
    (b"{oops", {"authorization": "Bearer sk-alpha"}),
    (b'{"messages": [{"role": "user", "content": "x"}]}', {}),  # no key: the replica refuses
    (b'{"messages": [{"role": "user", "content": "x"}]}', {"authorization": "Bearer sk-nope"}),
])
def test_requests_without_a_valid_prompt_or_tenant_have_no_key(hasher, body, headers):
    assert hasher.key(CHAT_PATH, body, headers) is None


def test_tenants_never_share_a_chain(hasher):
    body = httpx.Request("POST", "/", json={"messages": MESSAGES}).content
    alpha = hasher.key(CHAT_PATH, body, {"authorization": "Bearer sk-alpha"})
    beta = hasher.key(CHAT_PATH, body, {"authorization": "Bearer sk-beta"})
    assert alpha.num_tokens == beta.num_tokens
    assert not set(alpha.chain) & set(beta.chain)


def test_clients_requests_hash_as_the_replica_sees_them(fleet, hasher):
    """Claude Code's attribution nonce never moves a prompt to another prefix; Codex's
    namespace and hosted tools hash (issue 26, docs/clients.md)."""
    from prefixgate.gateway.router.prompt import MESSAGES_PATH, RESPONSES_PATH

    system = "You are a coding agent. " * 20
    keys = []
    for nonce in ("0a9f1", "77c3e"):
        billing = f"x-anthropic-billing-header: cc_version=2.1.197.{nonce[:3]}; cch={nonce};"
        body = {"model": "claude-opus-4-8", "max_tokens": 64_000, "system": [
            {"type": "text", "text": billing}, {"type": "text", "text": system}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "Agent types: none."}]}
        keys.append(hasher.key(MESSAGES_PATH, httpx.Request("POST", "/", json=body).content,
                               {"x-api-key": "sk-alpha"}))
    assert keys[0] is not None and keys[0].chain == keys[1].chain
    # and the replica counts the same prompt (the fleet's replicas have no model aliases)
    counted = httpx.post(fleet.replicas[0].url + "/v1/messages/count_tokens", timeout=30,
                         json={k: v for k, v in body.items() if k != "model"})
    assert counted.json()["input_tokens"] == keys[0].num_tokens, counted.text
    codex = {"model": "gpt-5.1-codex", "input": "hi", "tools": [
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
         "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
        {"type": "web_search"}]}
    key = hasher.key(RESPONSES_PATH, httpx.Request("POST", "/", json=codex).content,
                     {"authorization": "Bearer sk-alpha"})
    assert key is not None and key.num_tokens > 0
    served = httpx.post(fleet.replicas[0].url + "/v1/responses", timeout=120, json={
        "input": "hi", "tools": codex["tools"], "max_output_tokens": 1, "store": False})
    assert served.json()["usage"]["input_tokens"] == key.num_tokens, served.text
