"""gateway/server/tools/prompt.py: the tools format is canonical and a tool loop's turns extend
each other's prompt text (so each turn hits the last turn's pages)."""

from __future__ import annotations

import json

import pytest

from prefixgate.engine.api import InvalidRequestError
from prefixgate.gateway.server.tools import FunctionTool, parse_output, prepare_messages
from prefixgate.gateway.server.tools.prompt import render_call, tools_section

WEATHER = FunctionTool("get_weather", "Weather of a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
NOOP = FunctionTool("noop")


def test_the_same_tools_give_the_same_bytes_whatever_strict_says():
    strict = tools_section([WEATHER, NOOP])
    loose = tools_section([FunctionTool(WEATHER.name, WEATHER.description, WEATHER.parameters,
                                        strict=False), NOOP])
    assert strict == loose
    lines = strict.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["get_weather", "noop"]
    assert json.loads(lines[1])["function"]["parameters"] == {"type": "object", "properties": {}}


def test_tools_join_the_system_turn_or_become_it():
    with_system = prepare_messages([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"}], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    without = prepare_messages([{"role": "user", "content": "hi"}], [WEATHER])
    assert without[0]["role"] == "system" and without[0]["content"].startswith("# Tools")
    assert prepare_messages([{"role": "user", "content": "hi"}], None) == [
        {"role": "user", "content": "hi"}]


def _render(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def test_each_turn_of_a_tool_loop_extends_the_last():
    generated = render_call("get_weather", {"city": "Paris"})
    _, calls = parse_output(generated)
    history = [{"role": "user", "content": "Weather in Paris?"}]
    turn1 = _render(prepare_messages(history, [WEATHER]))
    # the client sends back the parsed call (arguments as the JSON string it received)
    history += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"},
        {"role": "tool", "tool_call_id": "x", "content": "clear"},
    ]
    turn2_messages = prepare_messages(history, [WEATHER])
    turn2 = _render(turn2_messages)
    assert turn2.startswith(turn1)
    # the assistant turn is exactly what the model generated
    assert turn2_messages[2] == {"role": "assistant", "content": generated}
    # consecutive tool results share one user turn
    assert turn2_messages[3]["content"] == ("<tool_response>\n18 C\n</tool_response>\n"
                                            "<tool_response>\nclear\n</tool_response>")
    history += [{"role": "assistant", "content": "It is 18 C."},
                {"role": "user", "content": "And tomorrow?"}]
    assert _render(prepare_messages(history, [WEATHER])).startswith(turn2)


def test_history_calls_with_invalid_arguments_are_rendered_verbatim():
    """A call cut by max_tokens comes back from the client as it was sent: not a 400."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a": "b'}}]}]
    rendered = prepare_messages(messages, [NOOP])[2]["content"]
    assert rendered == '<tool_call>\n{"name": "f", "arguments": {"a": "b}\n</tool_call>'


def test_a_call_needs_a_function_name():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                "tool_calls": [{"id": "1", "function": {"arguments": "{}"}}]}]
    with pytest.raises(InvalidRequestError) as caught:
        prepare_messages(messages, [NOOP])
    assert caught.value.param == "messages[1].tool_calls[0]"
