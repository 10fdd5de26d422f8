"""The agent frameworks users point at the gateway (LangChain, its create_agent loop, the OpenAI
Agents SDK, pydantic-ai), driven against the live gateway on the real default model.

The model is tiny: under ``tool_choice="auto"`` it mostly answers in text, so every test that
needs a call forces it (a named function, "required"/"any", or a framework's own forcing), and
the grammar guarantees the call is valid. Each test checks what the framework got back against
the schema it sent (jsonschema), and, where a tool runs, that the Python function really ran.
Every request body a framework sends is recorded (an httpx event hook), so a failure shows it.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MAX_TOKENS = 100
ASK_WEATHER = "What is the weather in Paris right now? Use the tool."


class WeatherArgs(BaseModel):
    """Arguments of the weather tool (bounded strings and an enum, so calls terminate)."""

    city: str = Field(max_length=24, description="The city name.")
    unit: Literal["celsius", "fahrenheit"] = Field(description="The temperature unit.")


class City(BaseModel):
    """A city, as structured output."""

    name: str = Field(max_length=24)
    continent: Literal["Europe", "Asia", "Africa", "Americas", "Oceania"]
    is_capital: bool


class Recorder:
    """Keeps the JSON body of every request a framework sends (httpx request hook)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def _record(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    def sync_client(self) -> httpx.Client:
        return httpx.Client(timeout=120, event_hooks={"request": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        async def hook(request: httpx.Request) -> None:
            self._record(request)

        return httpx.AsyncClient(timeout=120, event_hooks={"request": [hook]})


@pytest.fixture()
def recorder() -> Recorder:
    return Recorder()


def weather_tool(calls: list[dict]):
    """A LangChain tool that records its arguments and returns a fixed, recognisable result."""
    from langchain_core.tools import StructuredTool

    def get_weather(city: str, unit: str) -> str:
        calls.append({"city": city, "unit": unit})
        return f"WEATHER-OK: 21 degrees {unit} in {city}"

    return StructuredTool.from_function(
        get_weather, name="get_weather", description="Current weather for a city.",
        args_schema=WeatherArgs)


def chat_openai(gateway, recorder: Recorder, max_tokens: int = MAX_TOKENS):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=gateway.open_url + "/v1", api_key="unused", model=gateway.model,
        temperature=0, max_tokens=max_tokens, max_retries=0,
        http_client=recorder.sync_client())


def sent_parameters(body: dict, name: str) -> dict:
    """The JSON schema the framework put on the wire for function ``name``."""
    for tool in body.get("tools") or ():
        if tool["function"]["name"] == name:
            return tool["function"]["parameters"]
    raise AssertionError(f"no tool {name!r} in the request: {body}")


# --------------------------------------------------------------------------------------------
# LangChain ChatOpenAI
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "wire_choice"), [
    ("get_weather", {"type": "function", "function": {"name": "get_weather"}}),
    ("any", "required"),  # LangChain's spelling of required
])
def test_langchain_bind_tools_forced_call_is_valid(gateway, recorder, choice, wire_choice):
    from langchain_core.messages import AIMessage, HumanMessage

    calls: list[dict] = []
    llm = chat_openai(gateway, recorder).bind_tools([weather_tool(calls)], tool_choice=choice)
    reply = llm.invoke([HumanMessage(ASK_WEATHER)])

    assert isinstance(reply, AIMessage)
    body = recorder.bodies[-1]
    assert body["tool_choice"] == wire_choice, body
    assert reply.response_metadata["finish_reason"] == "tool_calls", reply
    assert reply.tool_calls, reply
    assert not reply.invalid_tool_calls, reply.invalid_tool_calls
    schema = sent_parameters(body, "get_weather")
    for call in reply.tool_calls:
        assert call["name"] == "get_weather"
        assert call["id"].startswith("call_")
        jsonschema.validate(call["args"], schema)
        WeatherArgs.model_validate(call["args"])
    assert calls == []  # binding never runs the tool


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_a_valid_instance(gateway, recorder, method):
    from langchain_core.messages import HumanMessage

    llm = chat_openai(gateway, recorder).with_structured_output(
        City, method=method, include_raw=True)
    result = llm.invoke([HumanMessage("Describe the city of Paris as JSON.")])

    assert result["parsing_error"] is None, (result, recorder.bodies[-1])
    city = result["parsed"]
    assert isinstance(city, City), result
    assert 0 < len(city.name) <= 24
    assert city.continent in ("Europe", "Asia", "Africa", "Americas", "Oceania")
    assert isinstance(city.is_capital, bool)
    body = recorder.bodies[-1]
    if method == "json_schema":
        assert body["response_format"]["type"] == "json_schema", body
        schema = body["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(result["raw"].content), schema)
    else:
        assert body["tool_choice"]["function"]["name"] == "City", body
        jsonschema.validate(result["raw"].tool_calls[0]["args"], sent_parameters(body, "City"))


# --------------------------------------------------------------------------------------------
# LangChain create_agent: the tool really runs
# --------------------------------------------------------------------------------------------
def test_langchain_create_agent_runs_the_tool(gateway, recorder):
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    @wrap_model_call
    def call_once_then_answer(request, handler):
        # The tiny model rarely calls a tool on its own: force the first call, then forbid
        # more, so the loop ends after one round trip whatever the model would have chosen.
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if answered else "get_weather"))

    calls: list[dict] = []
    agent = create_agent(
        chat_openai(gateway, recorder, max_tokens=60), tools=[weather_tool(calls)],
        system_prompt="You are a weather assistant.", middleware=[call_once_then_answer])
    state = agent.invoke({"messages": [HumanMessage(ASK_WEATHER)]},
                         config={"recursion_limit": 8})

    assert len(calls) == 1, calls
    schema = sent_parameters(recorder.bodies[0], "get_weather")
    jsonschema.validate(calls[0], schema)
    messages = state["messages"]
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    assert len(tool_messages) == 1, messages
    expected = f"WEATHER-OK: 21 degrees {calls[0]['unit']} in {calls[0]['city']}"
    assert tool_messages[0].content == expected
    asked = next(m for m in messages if isinstance(m, AIMessage) and m.tool_calls)
    assert tool_messages[0].tool_call_id == asked.tool_calls[0]["id"]
    # the loop went model → tool → model and ended in a text answer
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
    assert [b.get("tool_choice") for b in recorder.bodies] == [
        {"type": "function", "function": {"name": "get_weather"}}, "none"]
    # the second request sends the call and its result back in OpenAI's shape
    history = recorder.bodies[1]["messages"]
    assert history[-1] == {"role": "tool", "content": expected,
                           "tool_call_id": asked.tool_calls[0]["id"]}


# --------------------------------------------------------------------------------------------
# OpenAI Agents SDK
# --------------------------------------------------------------------------------------------
def test_openai_agents_sdk_runs_the_tool(gateway, recorder):
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no exporter, no network
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather for a city.

        Args:
            city: The city name.
            unit: The temperature unit.
        """
        calls.append({"city": city, "unit": unit})
        return f"WEATHER-OK: 21 degrees {unit} in {city}"

    client = openai.AsyncOpenAI(base_url=gateway.open_url + "/v1", api_key="x", max_retries=0,
                                http_client=recorder.async_client())
    agent = Agent(
        name="weather",
        instructions="You are a weather assistant.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=gateway.model, openai_client=client),
        # reset_tool_choice (the default) drops "required" after the call, so the loop ends
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    # max_tokens=80 cuts the second of two parallel calls inside its closing tag: its
    # arguments still come back whole, and the SDK's next turn sends that history back
    result = Runner.run_sync(agent, ASK_WEATHER, max_turns=4)

    assert len(calls) >= 1, result
    schema = get_weather.params_json_schema
    assert sent_parameters(recorder.bodies[0], "get_weather") == schema
    for arguments in calls:
        jsonschema.validate(arguments, schema)
    assert recorder.bodies[0]["tool_choice"] == "required"
    assert recorder.bodies[-1].get("tool_choice") != "required"
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert f"WEATHER-OK: 21 degrees {calls[0]['unit']} in {calls[0]['city']}" in outputs
    assert isinstance(result.final_output, str)


# --------------------------------------------------------------------------------------------
# pydantic-ai
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_output_type_is_a_valid_instance(gateway, recorder, mode):
    import openai
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=gateway.open_url + "/v1", api_key="x", max_retries=0,
                                http_client=recorder.async_client())
    model = OpenAIChatModel(gateway.model, provider=OpenAIProvider(openai_client=client))
    output_type = City if mode == "tool" else NativeOutput(City)
    agent = Agent(model, output_type=output_type,
                  model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
    result = agent.run_sync("Describe the city of Paris.")

    city = result.output
    assert isinstance(city, City), city
    assert 0 < len(city.name) <= 24
    assert isinstance(city.is_capital, bool)
    body = recorder.bodies[-1]
    if mode == "tool":
        # output through a forced call of pydantic-ai's one output tool
        (tool,) = body["tools"]
        assert tool["function"]["name"] == "final_result"
        assert body["tool_choice"] == "required", body
        jsonschema.validate(city.model_dump(), tool["function"]["parameters"])
    else:
        assert body["response_format"]["type"] == "json_schema", body
        jsonschema.validate(city.model_dump(), body["response_format"]["json_schema"]["schema"])

