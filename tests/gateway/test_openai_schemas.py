"""Request models: normalisation of the OpenAI shapes and the bounds (no server needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefixgate.gateway.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from prefixgate.gateway.server.tools import FunctionTool

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "x"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_text_parts_are_joined_and_developer_is_system():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "rules"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    assert request.template_messages() == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
    ]


GREP = [FunctionTool("grep", None, {"type": "object"})]


def test_tools_reach_the_template_unless_tool_choice_is_none():
    assert chat(tools=TOOLS).template_tools() == GREP
    assert chat(tools=TOOLS, tool_choice="auto").template_tools() == GREP
    assert chat(tools=TOOLS, tool_choice="none").template_tools() is None
    named = {"type": "function", "function": {"name": "grep"}}
    assert chat(tools=TOOLS, tool_choice=named).template_tools() == GREP
    with pytest.raises(ValidationError, match="not in tools"):
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}})
    tokenize = TokenizeRequest.model_validate(
        {"messages": USER, "tools": TOOLS, "tool_choice": "none"}
    )
    assert tokenize.tool_choice == "none"


def test_stop_and_max_tokens_spellings():
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", "b"]).stop == ["a", "b"]
    assert chat().stop == []
    assert chat(max_completion_tokens=7, max_tokens=3).requested_max_tokens == 7
    assert chat(max_tokens=3).requested_max_tokens == 3
    with pytest.raises(ValidationError):
        chat(stop=[""])
    with pytest.raises(ValidationError):
        chat(stop=[str(i) for i in range(17)])


def test_include_usage_only_when_streaming():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize(
    ("prompt", "normalised"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_shapes(prompt, normalised):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == normalised


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 17},
        {"top_logprobs": 3},  # needs logprobs=true
        {"logprobs": True, "top_logprobs": 21},
        {"presence_penalty": 3},
        {"min_p": 1.5},
        {"repetition_penalty": 0},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema"}},  # the schema is missing
        {"tool_choice": "required"},  # with no tools
        {"user": ""},
    ],
)
def test_bounds(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_unsupported_completion_options_are_rejected():
    for fields in ({"echo": True}, {"suffix": "x"}, {"best_of": 3}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **fields})


def test_unknown_fields_are_ignored():
    request = chat(store=True, metadata={"a": "b"}, parallel_tool_calls=False)
    assert not hasattr(request, "store")
