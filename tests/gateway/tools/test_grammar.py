"""gateway/server/tools/grammar.py: tool_choice / response_format → the grammar the engine
enforces, checked by feeding texts to a real xgrammar matcher (the default model's tokenizer)."""

from __future__ import annotations

import json

import pytest

from prefixgate.engine.api import GrammarSpec, InvalidRequestError
from prefixgate.engine.grammar import GrammarCompiler, new_matcher
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice, tool_grammar
from prefixgate.gateway.server.tools.grammar import MAX_SCHEMA_DEPTH, schema_depth
from prefixgate.gateway.server.tools.prompt import render_call

WEATHER = FunctionTool("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False})
TIME = FunctionTool("get_time", None, {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]})
TOOLS = [WEATHER, TIME]
PARIS = render_call("get_weather", {"city": "Paris"})
UTC = render_call("get_time", {"zone": "UTC"})


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    """The whole text is allowed and the grammar may end after it."""
    matcher = new_matcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


def grammar(choice: ToolChoice, response=None) -> GrammarSpec:
    spec = tool_grammar(TOOLS, choice, response, lambda i: f"tools[{i}].function.parameters")
    assert spec is not None
    return spec


def test_required_allows_only_calls_and_at_least_one(compiler):
    spec = grammar(ToolChoice("required"))
    assert accepts(compiler, spec, PARIS)
    assert accepts(compiler, spec, PARIS + "\n" + UTC)
    assert not accepts(compiler, spec, "Hello")
    assert not accepts(compiler, spec, "")
    assert not accepts(compiler, spec, render_call("get_weather", {"city": "Paris", "x": 1}))
    assert not accepts(compiler, spec, render_call("get_time", {"zone": "PST"}))
    assert not accepts(compiler, spec, render_call("rm_rf", {}))
    # canonical JSON only: the re-rendered call in the next prompt is byte-identical
    assert not accepts(compiler, spec, PARIS.replace('{"city": "Paris"}', '{"city":"Paris"}'))


def test_parallel_false_and_named_stop_after_one_call(compiler):
    assert not accepts(compiler, grammar(ToolChoice("required", parallel=False)), PARIS + "\n" + UTC)
    named = grammar(ToolChoice("function", "get_time"))
    assert accepts(compiler, named, UTC)
    assert not accepts(compiler, named, PARIS)
    assert not accepts(compiler, named, UTC + "\n" + UTC)


def test_auto_allows_text_or_calls(compiler):
    spec = grammar(ToolChoice("auto"))
    assert accepts(compiler, spec, "It is sunny.")
    assert accepts(compiler, spec, "Checking.\n" + PARIS)
    assert not accepts(compiler, spec, "Checking.\n<tool_call>\n{\"name\": \"nope\"")


def test_auto_with_a_json_response_format_is_the_answer_or_calls(compiler):
    response = GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}))
    spec = grammar(ToolChoice("auto"), response)
    assert accepts(compiler, spec, '{"answer": 4}')
    assert accepts(compiler, spec, PARIS)
    assert not accepts(compiler, spec, "four")
    # a forced call wins over the format (OpenAI accepts both): the output is the call alone
    forced = grammar(ToolChoice("required"), response)
    assert forced == grammar(ToolChoice("required"))
    assert accepts(compiler, forced, PARIS)
    assert not accepts(compiler, forced, '{"answer": 4}')


def test_none_leaves_only_the_response_format():
    response = GrammarSpec("json_object")
    assert tool_grammar(TOOLS, ToolChoice("none"), response, str) is response
    assert tool_grammar([], ToolChoice("auto"), None, str) is None


def test_bad_schemas_are_400s_naming_the_tool():
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(300):  # 300 levels: refused before any recursive converter sees it
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]
    assert schema_depth(deep) > MAX_SCHEMA_DEPTH
    cases = [
        (FunctionTool("f", None, {"type": "string"}), "object schema"),
        (FunctionTool("f", None, deep), "deeper than"),
        (FunctionTool("f", None, {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "("}}}), "cannot be compiled"),
    ]
    for tool, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            tool_grammar([WEATHER, tool], ToolChoice("auto"), None,
                         lambda i: f"tools[{i}].function.parameters")
        assert caught.value.param == "tools[1].function.parameters"
