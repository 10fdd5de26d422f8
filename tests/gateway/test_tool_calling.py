"""Tool calling and structured outputs through the official openai SDK, against the live
gateway on the real default model. Every call's arguments are validated against its
function's schema (jsonschema), not only parsed."""

from __future__ import annotations

import json

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
