"""The OpenAI Responses API through the official SDKs against the live gateway (real model):
text and function calls, streamed and not, state through previous_response_id (the next turn
extends the last one's tokens and hits its pages), GET / DELETE, tenancy, and the Agents SDK's
default (Responses) model running a function_tool to completion."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.live_gateway import KEY_ALPHA, KEY_BETA, wait_idle

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
    "strict": True,
}
ASK = "What is the weather in Paris?"


@pytest.fixture()
def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.open_url + "/v1", api_key="unused", max_retries=0)


def calls_of(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return calls


def test_text_response_with_usage(sdk, gateway):
    response = sdk.responses.create(model=gateway.model, input=ASK, instructions="Be brief.",
                                    temperature=0, max_output_tokens=16)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens >= 0


def test_required_function_call_streamed_and_not(sdk, gateway):
    kwargs = dict(model=gateway.model, input=ASK, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    whole = sdk.responses.create(**kwargs)
    (call,) = calls_of(whole)
    kinds, arguments, final = [], "", None
    with sdk.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert arguments == call.arguments
    (streamed,) = calls_of(final)
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def test_previous_response_id_continues_and_hits_the_cache(sdk, gateway, client):
    first = sdk.responses.create(model=gateway.model, input=ASK, tools=[WEATHER],
                                 tool_choice="required", parallel_tool_calls=False,
                                 instructions="You are a weather agent.", temperature=0,
                                 max_output_tokens=80)
    (call,) = calls_of(first)
    second = sdk.responses.create(
        model=gateway.model, previous_response_id=first.id, tools=[WEATHER],
        instructions="You are a weather agent.", temperature=0, max_output_tokens=12,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    # only the new item was sent; the server knew the rest, token for token
    assert second.usage.input_tokens > first.usage.input_tokens
    floor = first.usage.input_tokens // gateway.page_size * gateway.page_size
    assert second.usage.input_tokens_details.cached_tokens >= floor
    assert second.previous_response_id == first.id
    fetched = sdk.responses.retrieve(first.id)
    assert fetched.id == first.id and calls_of(fetched)[0].arguments == call.arguments
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=gateway.model, input="x", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert wait_idle(client)["pages_used"] == 0


def test_stored_responses_are_private_to_their_tenant(gateway):
    alpha = openai.OpenAI(base_url=gateway.auth_url + "/v1", api_key=KEY_ALPHA, max_retries=0)
    beta = openai.OpenAI(base_url=gateway.auth_url + "/v1", api_key=KEY_BETA, max_retries=0)
    mine = alpha.responses.create(model=gateway.model, input="Hello", max_output_tokens=4,
                                  temperature=0)
    assert alpha.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(mine.id)
    with pytest.raises(openai.BadRequestError):
        beta.responses.create(model=gateway.model, input="x", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(mine.id)
    assert alpha.responses.retrieve(mine.id).id == mine.id  # beta's delete changed nothing


def test_json_schema_text_format(sdk, gateway):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}},
              "required": ["answer"], "additionalProperties": False}
    response = sdk.responses.create(
        model=gateway.model, input="What is 2 + 2? Answer in JSON.", temperature=0,
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_bad_requests_are_400s_naming_the_field(client, gateway):
    for extra, param in [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools[0].parameters"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ]:
        response = client.post("/v1/responses", json={"model": gateway.model, "input": "x", **extra})
        assert response.status_code == 400, (extra, response.text)
        assert (response.json()["error"]["param"] or "").startswith(param), response.json()


def test_agents_sdk_default_responses_model_runs_a_tool(gateway):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather for a city.

        Args:
            city: The city.
            unit: celsius or fahrenheit.
        """
        calls.append({"city": city, "unit": unit})
        return f"WEATHER-OK 21 {unit} in {city}"

    client = openai.AsyncOpenAI(base_url=gateway.open_url + "/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(timeout=120))
    agent = Agent(name="weather", instructions="You are a weather assistant.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=gateway.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=60, parallel_tool_calls=False))
    result = Runner.run_sync(agent, ASK, max_turns=4)
    assert calls, result
    for arguments in calls:
        jsonschema.validate(arguments, get_weather.params_json_schema)
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert f"WEATHER-OK 21 {calls[0]['unit']} in {calls[0]['city']}" in outputs
    assert isinstance(result.final_output, str)


def _cap_cases() -> list[tuple[str, dict, dict]]:
    """(param, just inside, just outside): Responses text fields bounded as chat content."""
    from prefixgate.gateway.server.fields import MAX_CONTENT_PARTS, MAX_TEXT_CHARS

    def parts(n: int, chars: int = 1) -> list[dict]:
        return [{"type": "input_text", "text": "x" * chars}] * n

    def message(content: object) -> dict:
        return {"input": [{"role": "user", "content": content}]}

    def output(text: str) -> dict:
        return {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1", "output": text}]}

    return [
        ("input", {"input": "x" * MAX_TEXT_CHARS}, {"input": "x" * (MAX_TEXT_CHARS + 1)}),
        ("input[0].content", message("x" * MAX_TEXT_CHARS), message("x" * (MAX_TEXT_CHARS + 1))),
        ("input[0].content[0].text", message(parts(1, MAX_TEXT_CHARS)),
         message(parts(1, MAX_TEXT_CHARS + 1))),
        ("input[0].content", message(parts(MAX_CONTENT_PARTS)), message(parts(MAX_CONTENT_PARTS + 1))),
        ("input[1].output", output("x" * MAX_TEXT_CHARS), output("x" * (MAX_TEXT_CHARS + 1))),
    ]


@pytest.mark.parametrize(("param", "inside", "outside"), _cap_cases(),
                         ids=[case[0] for case in _cap_cases()])
def test_input_text_has_the_chat_content_caps(client, param, inside, outside):
    """A Responses input string, message content and tool output have chat content's bounds:
    just inside validates, just outside is a 400 in OpenAI's envelope naming the field."""
    from prefixgate.gateway.server.responses.schemas import ResponsesRequest

    ResponsesRequest.model_validate(inside)
    response = client.post("/v1/responses", json={**outside, "max_output_tokens": 1})
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    assert "should have at most" in body["error"]["message"], body
