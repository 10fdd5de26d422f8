"""Tool calling and structured outputs through the official openai SDK, against the live
gateway on the real default model. Every call's arguments are validated against its
function's schema (jsonschema), not only parsed."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_gateway import wait_idle

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 32}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture()
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.open_url + "/v1", api_key="unused", max_retries=0)


def check_calls(message, names=None) -> list[dict]:
    """Every call has an id, a known name and arguments valid against its schema."""
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in SCHEMAS
        if names is not None:
            assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append({"name": call.function.name, "arguments": arguments})
    return calls


def test_required_tool_choice_returns_a_valid_call(sdk, gateway):
    response = sdk.chat.completions.create(
        model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=80)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message)
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_choice_calls_exactly_that_function(sdk, gateway):
    response = sdk.chat.completions.create(
        model=gateway.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = check_calls(choice.message, names={"get_time"})
    assert len(calls) == 1


def test_streamed_call_reassembles_to_the_non_streamed_one(sdk, gateway):
    kwargs = dict(model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=80)
    whole = sdk.chat.completions.create(**kwargs).choices[0].message
    pieces: dict[int, dict] = {}
    finish = None
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.index not in pieces:
                    # the first chunk of a call carries its index, id and name
                    assert call.id and call.function.name, call
                    pieces[call.index] = {"id": call.id, "name": call.function.name,
                                          "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                pieces[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], p["arguments"]) for _, p in sorted(pieces.items())] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]
    for p in pieces.values():
        jsonschema.validate(json.loads(p["arguments"]), SCHEMAS[p["name"]])


def test_a_tool_loop_extends_its_prompt_and_hits_the_cache(sdk, gateway, client):
    """Turn n+1's prompt starts with turn n's tokens; its cached tokens cover turn n's pages."""
    messages = [{"role": "system", "content": "You are a weather agent. Use the tools."},
                {"role": "user", "content": "Weather in Lyon, then the time in UTC?"}]
    previous: list[int] = []
    for turn in range(3):
        ids = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        assert ids[: len(previous)] == previous  # token-exact extension of the last turn
        response = sdk.chat.completions.create(
            model=gateway.model, messages=messages, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=60, user="loop-agent")
        usage = response.usage
        assert usage.prompt_tokens == len(ids)
        if turn:
            floor = len(previous) // gateway.page_size * gateway.page_size
            assert usage.prompt_tokens_details.cached_tokens >= floor, (turn, usage)
        message = response.choices[0].message
        (call,) = check_calls(message)
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                         "content": json.dumps({"ok": True, "turn": turn})})
        previous = ids
    assert wait_idle(client)["pages_used"] == 0


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    days: int = Field(ge=1, le=7)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def test_parse_with_a_pydantic_model(sdk, gateway):
    completion = sdk.chat.completions.parse(
        model=gateway.model, response_format=Forecast, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Forecast for Paris, 3 days, in celsius."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast), completion
    assert 1 <= parsed.days <= 7 and parsed.unit in ("celsius", "fahrenheit")


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_and_json_object_outputs(sdk, gateway, strict):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                          "maximum": 100}},
              "required": ["answer"], "additionalProperties": False}
    response = sdk.chat.completions.create(
        model=gateway.model, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is 2 + 2? Reply as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "sum", "schema": schema, "strict": strict}})
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    response = sdk.chat.completions.create(
        model=gateway.model, temperature=0, max_tokens=40, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_extras_choice_and_regex(client, gateway):
    body = {"model": gateway.model, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "Is the sky blue?"}]}
    choice = client.post("/v1/chat/completions", json={
        **body, "response_format": {"type": "choice", "choice": ["yes", "no"]}}).json()
    assert choice["choices"][0]["message"]["content"] in ("yes", "no")
    regex = client.post("/v1/chat/completions", json={
        **body, "response_format": {"type": "regex", "regex": "[A-Z]{3}-[0-9]{2}"}}).json()
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex["choices"][0]["message"]["content"])


def test_tool_choice_none_hides_the_tools(client, gateway):
    body = {"model": gateway.model, "messages": ASK}
    with_tools = client.post("/tokenize", json={**body, "tools": TOOLS}).json()["count"]
    hidden = client.post("/tokenize", json={**body, "tools": TOOLS, "tool_choice": "none"}).json()
    assert hidden["count"] == client.post("/tokenize", json=body).json()["count"] < with_tools
    response = client.post("/v1/chat/completions", json={
        **body, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 16}).json()
    assert response["choices"][0]["message"].get("tool_calls") is None
    assert response["choices"][0]["finish_reason"] in ("stop", "length")


BAD_REQUESTS = [
    # (what is wrong, extra body fields, the param the 400 names)
    ("uncompilable schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("parameters not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ("unknown named tool", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "rm"}}}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    # a forced call plus response_format is accepted (the call wins): tests/gateway/test_clients.py
    ("duplicate tool names", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("bad regex", {"response_format": {"type": "regex", "regex": "(("}}, "response_format.regex"),
    ("300-level schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": json.loads('{"type": "object", "properties": {"a": ' * 300
                                             + '{}' + '}}' * 300)}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("what,extra,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_tool_and_format_requests_get_a_400_naming_the_field(client, gateway, what, extra, param):
    response = client.post("/v1/chat/completions", json={
        "model": gateway.model, "messages": ASK, "max_tokens": 8, **extra})
    assert response.status_code == 400, (what, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param), (what, error)


def test_bad_requests_harm_no_one(sdk, gateway, client):
    """A well-formed constrained request streaming meanwhile is unaffected; nothing leaks."""
    kwargs = dict(model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=60)
    reference = sdk.chat.completions.create(**kwargs).choices[0].message.tool_calls
    stream = sdk.chat.completions.create(stream=True, **kwargs)
    arguments = ""
    for i, chunk in enumerate(stream):
        if i == 2:  # mid-stream, every bad request in turn
            for _, extra, _ in BAD_REQUESTS:
                assert client.post("/v1/chat/completions", json={
                    "model": gateway.model, "messages": ASK, "max_tokens": 8,
                    **extra}).status_code == 400
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.index == 0:
                    arguments += call.function.arguments or ""
    assert arguments == reference[0].function.arguments
    stats = wait_idle(client)
    assert stats["pages_used"] == stats["pages_pinned"]


def test_metrics_count_constrained_tokens_and_compile_cache_hits(sdk, gateway, client):
    def scrape() -> dict[str, float]:
        out = {}
        for line in client.get("/metrics").text.splitlines():
            for name in ("constrained_tokens_total", "grammar_compiles_total",
                         "grammar_cache_hits_total"):
                if line.startswith(f"prefixgate:{name}{{"):
                    out[name] = float(line.rsplit(" ", 1)[1])
        return out

    before = scrape()
    for _ in range(2):  # the same tool list twice: at most one compile, then a cache hit
        sdk.chat.completions.create(model=gateway.model, messages=ASK, tools=TOOLS,
                                    tool_choice="required", temperature=0, max_tokens=60)
    after = scrape()
    assert after["grammar_compiles_total"] - before["grammar_compiles_total"] <= 1
    assert after["grammar_cache_hits_total"] - before["grammar_cache_hits_total"] >= 1
    assert after["constrained_tokens_total"] - before["constrained_tokens_total"] >= 20


def test_a_response_ending_in_tool_calls_retains_its_conversation(sdk, gateway, client, engine):
    """The agent will come back with the tool's result: its prefix is kept ahead of the LRU
    (X-Retention-Seconds: 0 opts out)."""
    import time

    def retained_after(headers: dict[str, str]) -> int:
        assert client.post("/v1/cache/reset").status_code == 200
        wait_idle(client)
        assert engine.cache_stats().pages_retained == 0
        response = sdk.chat.completions.create(
            model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=60, extra_headers=headers)
        assert response.choices[0].finish_reason == "tool_calls"
        deadline = time.monotonic() + 10  # retention runs in the background after the response
        while engine.cache_stats().pages_retained == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return engine.cache_stats().pages_retained

    prompt = len(client.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["tokens"])
    assert retained_after({}) >= prompt // gateway.page_size
    assert client.get("/v1/cache/stats").json()["pages_retained"] >= prompt // gateway.page_size
    assert retained_after({"X-Retention-Seconds": "0"}) == 0


def test_auto_tool_choice_answers_in_text_or_valid_calls(sdk, gateway):
    """auto: the model decides (this small model answers in text here); whatever it does, the
    message is well formed: text without the call format leaking, or calls valid for their
    schema; streamed and whole agree. (That a started call is forced valid under auto is
    checked on the grammar itself: tests/gateway/tools/test_grammar.py.)"""
    kwargs = dict(model=gateway.model, messages=ASK, tools=TOOLS, tool_choice="auto",
                  temperature=0, max_tokens=40)
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    if whole.message.tool_calls:
        check_calls(whole.message)
        assert whole.finish_reason in ("tool_calls", "length")
    else:
        assert whole.message.content and "<tool_call>" not in whole.message.content
        assert whole.finish_reason in ("stop", "length")
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in sdk.chat.completions.create(stream=True, **kwargs)
                       if chunk.choices)
    assert streamed == (whole.message.content or "")
