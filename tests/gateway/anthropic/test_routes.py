"""The Anthropic Messages API through the official ``anthropic`` SDK, against the live gateway
(real default model): text, streaming, enforced tool_use with schema-valid input, stop
sequences, cache usage from real page hits, count_tokens, auth headers and the error envelope."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest

from tests.live_gateway import ADMIN_KEY, KEY_ALPHA, wait_idle

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK release dropped the sampling arguments; the API keeps them
SYSTEM = ("You are a careful weather assistant for a team of travel agents. Always answer "
          "briefly and never invent numbers. ") * 6


@pytest.fixture()
def claude(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.open_url, api_key="unused", max_retries=0)


def test_text_message_and_usage_add_up(claude, gateway):
    message = claude.messages.create(model=gateway.model, max_tokens=16, extra_body=GREEDY,
                                     messages=ASK)
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=gateway.model, messages=ASK)
    usage = message.usage
    assert (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens) == counted.input_tokens
    assert usage.output_tokens >= 1


def test_streaming_equals_the_whole_message(claude, gateway):
    kwargs = dict(model=gateway.model, max_tokens=20, extra_body=GREEDY, messages=ASK)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_returns_a_valid_tool_use(claude, gateway, stream):
    kwargs = dict(model=gateway.model, max_tokens=80, extra_body=GREEDY, messages=ASK,
                  tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    if stream:
        with claude.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    # the loop continues: the result goes back as a tool_result block
    follow = claude.messages.create(
        model=gateway.model, max_tokens=16, extra_body=GREEDY, tools=[WEATHER],
        messages=[*ASK, {"role": "assistant", "content": message.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 C and clear"}]}])
    assert follow.usage.cache_read_input_tokens > 0  # it extends the first turn's prompt


def test_cache_control_second_call_reads_the_cache(claude, gateway, engine):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = claude.messages.create(model=gateway.model, max_tokens=4, extra_body=GREEDY,
                                   system=system, messages=[{"role": "user", "content": "Rome?"}])
    second = claude.messages.create(model=gateway.model, max_tokens=4, extra_body=GREEDY,
                                    system=system, messages=[{"role": "user", "content": "Oslo?"}])
    assert first.usage.cache_creation_input_tokens > 0
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - 16
    # the breakpoint's prefix is retained (5 minutes by default) ahead of the LRU
    deadline = time.monotonic() + 10
    while engine.cache_stats().pages_retained == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.cache_stats().pages_retained >= first.usage.cache_creation_input_tokens // 16


def test_output_config_json_schema_is_enforced(claude, gateway):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    message = claude.messages.create(model=gateway.model, max_tokens=40, extra_body=GREEDY,
                                     messages=ASK, output_config={"format": {
                                         "type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_stop_sequence_is_reported(claude, gateway):
    free = claude.messages.create(model=gateway.model, max_tokens=24, extra_body=GREEDY, messages=ASK)
    words = free.content[0].text.split()
    assert len(words) >= 3
    stop = words[2]
    message = claude.messages.create(model=gateway.model, max_tokens=24, extra_body=GREEDY,
                                     messages=ASK, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text


def test_x_api_key_auth_and_the_anthropic_error_envelope(gateway, client):
    with httpx.Client(base_url=gateway.auth_url, timeout=60) as c:
        body = {"model": gateway.model, "max_tokens": 4, "messages": ASK}
        ok = c.post("/v1/messages", json=body,
                    headers={"x-api-key": KEY_ALPHA, "anthropic-version": "2023-06-01"})
        assert ok.status_code == 200, ok.text
        denied = c.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
        assert denied.status_code == 401
        assert denied.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": denied.json()["error"]["message"]}}
        bearer = c.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert bearer.status_code == 200
    for bad, field in [
        ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {
            "type": "tool", "name": "nope"}}, "tool_choice"),
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "messages"),
        ({"max_tokens": 4, "messages": ASK, "tools": [{**WEATHER, "input_schema": {
            "type": "string"}}]}, "tools[0].input_schema"),
    ]:
        response = client.post("/v1/messages", json={"model": gateway.model, **bad})
        assert response.status_code == 400, (bad, response.text)
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"], error
    assert wait_idle(client)["pages_used"] == 0


THINKING = {"type": "thinking", "thinking": "", "signature": ""}  # what a schema fuzz sent


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_thinking_blocks_beside_cache_control_are_answered(client, gateway, role):
    """Thinking blocks carry no cache_control: reading the breakpoints skips them (was a 500,
    AttributeError in cache_ttl_s), wherever they stand."""
    blocks = [THINKING, {"type": "redacted_thinking", "data": "opaque"},
              {"type": "text", "text": "Paris?", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": role, "content": blocks}]
    if role == "assistant":
        messages = [*ASK, *messages, {"role": "user", "content": [
            THINKING, {"type": "text", "text": "And Rome?"}]}]
    response = client.post("/v1/messages", json={"model": gateway.model, "max_tokens": 2,
                                                 "messages": messages, **GREEDY})
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


def test_cache_ttl_reads_every_block_that_can_carry_one():
    from prefixgate.gateway.server.anthropic.schemas import MessagesRequest

    hour = {"type": "ephemeral", "ttl": "1h"}
    request = MessagesRequest.model_validate({"max_tokens": 1, "messages": [{"role": "user", "content": [
        THINKING, {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "18 C", "cache_control": hour}]}]}]})
    assert request.cache_ttl_s() == 3600.0  # a breakpoint inside a tool result counts
    plain = MessagesRequest.model_validate({"max_tokens": 1, "messages": [
        {"role": "user", "content": [THINKING, {"type": "text", "text": "hi"}]}]})
    assert plain.cache_ttl_s() is None


def _cap_cases() -> list[tuple[str, dict, dict]]:
    """(field, just inside, just outside): Messages text fields bounded as chat content."""
    from prefixgate.gateway.server.fields import MAX_CONTENT_PARTS, MAX_TEXT_CHARS

    def text(chars: int) -> dict:
        return {"type": "text", "text": "x" * chars}

    def user(content: object) -> dict:
        return {"messages": [{"role": "user", "content": content}]}

    def result(content: object) -> dict:
        return user([{"type": "tool_result", "tool_use_id": "t1", "content": content}])

    return [
        ("messages[0].content[0].text", user([text(MAX_TEXT_CHARS)]), user([text(MAX_TEXT_CHARS + 1)])),
        ("messages[0].content", user("x" * MAX_TEXT_CHARS), user("x" * (MAX_TEXT_CHARS + 1))),
        ("messages[0].content", user([text(1)] * MAX_CONTENT_PARTS), user([text(1)] * (MAX_CONTENT_PARTS + 1))),
        ("system[0].text", {**user("hi"), "system": [text(MAX_TEXT_CHARS)]},
         {**user("hi"), "system": [text(MAX_TEXT_CHARS + 1)]}),
        ("system", {**user("hi"), "system": "x" * MAX_TEXT_CHARS},
         {**user("hi"), "system": "x" * (MAX_TEXT_CHARS + 1)}),
        ("messages[0].content[0].content[0].text", result([text(MAX_TEXT_CHARS)]),
         result([text(MAX_TEXT_CHARS + 1)])),
        ("messages[0].content[0].content", result("x" * MAX_TEXT_CHARS), result("x" * (MAX_TEXT_CHARS + 1))),
    ]


@pytest.mark.parametrize(("field", "inside", "outside"), _cap_cases(),
                         ids=[case[0] for case in _cap_cases()])
def test_text_blocks_have_the_chat_content_caps(client, field, inside, outside):
    """Text blocks, string content, system and tool results have chat content's bounds: just
    inside validates, just outside is a 400 in Anthropic's envelope naming the field."""
    from prefixgate.gateway.server.anthropic.schemas import MessagesRequest

    MessagesRequest.model_validate({"max_tokens": 1, **inside})
    response = client.post("/v1/messages", json={"max_tokens": 1, **outside})
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert f"'{field}'" in body["error"]["message"] and "should have at most" in body["error"]["message"], body
