"""The repeat guard (gateway/server/tools/repeats.py) through the real SDKs (``openai`` on chat
and Responses, the OpenAI Agents SDK on Responses, ``anthropic`` on Messages) against the live
gateway on the default model, with default server settings (issue 37, section 2).

With ``tool_choice`` "required", parallel calls on and ``max_tokens`` 64, the default model
writes ``get_weather({"city": "Paris"})``, then the same call again, and the budget runs out
one token short of the repeat's closing tag (``...{"city": "Paris"}}\\n</tool_call``). The turn
must still end at the repeat, as a turn of one call that stopped on its own, on every surface,
streamed and not. Every call is checked against the tool's JSON schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.live_gateway import wait_idle

pytestmark = pytest.mark.slow

MAX_TOKENS = 64  # the budget the default model's repeat is cut at, inside its closing tag
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Get the weather for a city"
ASK = "What is the weather in Paris?"  # under "auto" the default model answers this in text
ASK_CALL = "Call get_weather for Paris."  # ... and calls on this one
PARIS = ("get_weather", {"city": "Paris"})


class Turn:
    """What a surface returned, neutrally: its own finish value, and the calls as
    ``(name, arguments)`` with the arguments parsed from the wire."""

    def __init__(self, finish: str | None, calls: list[tuple[str, Any]]):
        self.finish = finish
        self.calls = calls


def chat(sdk: openai.OpenAI, model: str, choice: str, parallel: bool, ask: str,
         stream: bool) -> Turn:
    wire_choice: Any = ({"type": "function", "function": {"name": "get_weather"}}
                        if choice == "named" else choice)
    kwargs: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": ask}], temperature=0,
        max_tokens=MAX_TOKENS, tool_choice=wire_choice, parallel_tool_calls=parallel,
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}])
    if not stream:
        choice_out = sdk.chat.completions.create(**kwargs).choices[0]
        return Turn(choice_out.finish_reason, [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice_out.message.tool_calls or ()])
    finish, names, arguments = None, {}, {}
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for delta_choice in chunk.choices:
            finish = delta_choice.finish_reason or finish
            for piece in delta_choice.delta.tool_calls or ():
                if piece.function and piece.function.name:
                    names[piece.index] = piece.function.name
                text = (piece.function.arguments if piece.function else None) or ""
                arguments[piece.index] = arguments.get(piece.index, "") + text
    return Turn(finish, [(names[i], json.loads(arguments[i])) for i in sorted(names)])


def responses(sdk: openai.OpenAI, model: str, choice: str, parallel: bool, ask: str,
              stream: bool) -> Turn:
    wire_choice: Any = {"type": "function", "name": "get_weather"} if choice == "named" else choice
    kwargs: dict[str, Any] = dict(
        model=model, input=ask, temperature=0, max_output_tokens=MAX_TOKENS,
        tool_choice=wire_choice, parallel_tool_calls=parallel,
        tools=[{"type": "function", "name": "get_weather", "description": DESCRIPTION,
                "parameters": PARAMETERS}])
    if stream:
        with sdk.responses.stream(**kwargs) as events:
            # the SDK raises here unless the stream ends in response.completed
            response = events.get_final_response()
    else:
        response = sdk.responses.create(**kwargs)
    return Turn(response.status, [(item.name, json.loads(item.arguments))
                                  for item in response.output if item.type == "function_call"])


def messages(client: anthropic.Anthropic, model: str, choice: str, parallel: bool, ask: str,
             stream: bool) -> Turn:
    wire_choice = {"required": {"type": "any"}, "auto": {"type": "auto"},
                   "named": {"type": "tool", "name": "get_weather"}}[choice]
    kwargs: dict[str, Any] = dict(
        model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask}],
        extra_body={"temperature": 0},  # this SDK release dropped the sampling arguments
        tool_choice={**wire_choice, "disable_parallel_tool_use": not parallel},
        tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}])
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    return Turn(message.stop_reason, [(block.name, block.input) for block in message.content
                                      if block.type == "tool_use"])


# (surface, streamed, the finish value of a turn that ended in calls)
SURFACES: list[tuple[Callable[..., Turn], bool, str]] = [
    (chat, False, "tool_calls"), (chat, True, "tool_calls"),
    (responses, False, "completed"), (responses, True, "completed"),
    (messages, False, "tool_use"), (messages, True, "tool_use"),
]
SURFACE_IDS = ["chat", "chat-stream", "responses", "responses-stream", "messages",
               "messages-stream"]


@pytest.fixture()
def clients(gateway) -> dict[Callable[..., Turn], Any]:
    sdk = openai.OpenAI(base_url=gateway.open_url + "/v1", api_key="unused", max_retries=0,
                        timeout=120)
    claude = anthropic.Anthropic(base_url=gateway.open_url, api_key="unused", max_retries=0,
                                 timeout=120)
    return {chat: sdk, responses: sdk, messages: claude}


def repeats_cut(gateway) -> int:
    stats = httpx.get(gateway.open_url + "/v1/cache/stats", timeout=30).json()
    return stats["clients"]["repeated_calls_cut"]


def check_calls(turn: Turn) -> None:
    """Every call validates against the tool's schema; none is an exact repeat."""
    for name, arguments in turn.calls:
        assert name == "get_weather"
        jsonschema.validate(arguments, PARAMETERS)
    unique = {json.dumps(call, sort_keys=True) for call in turn.calls}
    assert len(unique) == len(turn.calls), turn.calls


@pytest.mark.parametrize(("surface", "stream", "calls_finish"), SURFACES, ids=SURFACE_IDS)
def test_a_repeat_cut_by_max_tokens_in_its_closing_tag_still_ends_the_turn(
        gateway, clients, surface, stream, calls_finish):
    # issue 37: before, two identical calls and "length" / "incomplete" / "max_tokens"
    before = repeats_cut(gateway)
    turn = surface(clients[surface], gateway.model, "required", True, ASK, stream)
    check_calls(turn)
    assert (turn.finish, turn.calls) == (calls_finish, [PARIS])
    assert repeats_cut(gateway) == before + 1  # the guard ended it (not the model)
    with httpx.Client(base_url=gateway.open_url, timeout=30) as client:
        stats = wait_idle(client)  # the request ended early released its pages
    assert stats["pages_used"] == stats["pages_pinned"]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
@pytest.mark.parametrize("choice", ["required", "auto", "named"])
def test_every_tool_choice_ends_in_its_calls_with_a_small_budget(gateway, clients, choice,
                                                                 parallel):
    # the default model repeats only where the grammar lets it (required, parallel); every
    # setting must end the turn in valid calls, never in a truncation
    ask = ASK_CALL if choice == "auto" else ASK
    for surface, stream, calls_finish in SURFACES:
        turn = surface(clients[surface], gateway.model, choice, parallel, ask, stream)
        check_calls(turn)
        assert (turn.finish, turn.calls) == (calls_finish, [PARIS]), (surface.__name__, stream)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_the_agents_sdk_on_responses_runs_a_forced_call_on_a_small_budget(gateway, choice,
                                                                          parallel):
    # issue 37: before, the SDK raised ModelBehaviorError (response.incomplete,
    # max_output_tokens) on the first turn with parallel calls on
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no exporter, no network
    calls: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city.

        Args:
            city: The city name.
        """
        calls.append({"city": city})
        return f"WEATHER-OK: sunny in {city}"

    client = openai.AsyncOpenAI(base_url=gateway.open_url + "/v1", api_key="unused",
                                max_retries=0, http_client=httpx.AsyncClient(timeout=120))
    agent = Agent(
        name="weather", instructions="You are a weather assistant.", tools=[get_weather],
        model=OpenAIResponsesModel(model=gateway.model, openai_client=client),
        # reset_tool_choice (the default) drops the forced choice after the call
        model_settings=ModelSettings(tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS,
                                     parallel_tool_calls=parallel))
    result = Runner.run_sync(agent, ASK, max_turns=4)
    assert calls == [{"city": "Paris"}], result.new_items
    for arguments in calls:
        jsonschema.validate(arguments, get_weather.params_json_schema)
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == ["WEATHER-OK: sunny in Paris"]
    assert isinstance(result.final_output, str)
