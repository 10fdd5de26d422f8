"""One conversation, three API surfaces (OpenAI chat, OpenAI Responses, Anthropic Messages):
the same prompt token ids, so the same pages; each surface's request hits the pages the
previous surface's request left."""

from __future__ import annotations

import json

import pytest

from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.router.prompt import (
    CHAT_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    PromptHasher,
)

pytestmark = pytest.mark.slow

SYSTEM = "You are a travel agent with tools. Be brief and exact. " * 5
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGS = json.dumps({"city": "Paris"})

CHAT = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather",
                                                "description": "Weather.", "parameters": PARAMS}}],
}
RESPONSES = {
    "instructions": SYSTEM,
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, clear"},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks. And tomorrow?"}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
               "parameters": PARAMS}],
}
MESSAGES = {
    "system": [{"type": "text", "text": SYSTEM}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C, clear"},
            {"type": "text", "text": "Thanks. And tomorrow?"}]},
    ],
    "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": PARAMS}],
    "max_tokens": 4,
}


def test_the_three_surfaces_give_the_same_prompt_token_ids(tokenizer, client):
    """The replicas' rendering, as the router reproduces it, and /tokenize agree exactly."""
    hasher = PromptHasher(tokenizer, "m", 16, 0, KeyTable({}, None))
    chat, _, _ = hasher.token_ids(CHAT_PATH, CHAT)
    responses, _, _ = hasher.token_ids(RESPONSES_PATH, RESPONSES)
    messages, _, _ = hasher.token_ids(MESSAGES_PATH, MESSAGES)
    assert chat == responses == messages
    assert client.post("/tokenize", json=CHAT).json()["tokens"] == chat
    counted = client.post("/v1/messages/count_tokens", json=MESSAGES).json()["input_tokens"]
    assert counted == len(chat)


def test_each_surface_hits_the_pages_of_the_last(client, gateway):
    greedy = {"model": gateway.model, "temperature": 0}
    chat = client.post("/v1/chat/completions", json={**CHAT, **greedy, "max_tokens": 4}).json()
    prompt = chat["usage"]["prompt_tokens"]
    floor = (prompt - 1) // gateway.page_size * gateway.page_size
    responses = client.post("/v1/responses", json={
        **RESPONSES, **greedy, "max_output_tokens": 4, "store": False}).json()
    assert responses["usage"]["input_tokens"] == prompt
    assert responses["usage"]["input_tokens_details"]["cached_tokens"] >= floor
    messages = client.post("/v1/messages", json={**MESSAGES, **greedy}).json()
    usage = messages["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage[
        "cache_creation_input_tokens"] == prompt
    assert usage["cache_read_input_tokens"] >= floor
