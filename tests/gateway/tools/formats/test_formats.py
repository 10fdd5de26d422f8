"""Tool-call formats against the real chat templates of llama.cpp's sources (the sdist).

Per format: the template that teaches it is detected; a call rendered into the history by
that template parses back to the same call (so what the model learnt is what we read); the
grammar accepts the format's own call and rejects the others'; streaming parses like whole.
"""

from __future__ import annotations

import json

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from prefixgate.engine.chat_template import ChatTemplate
from prefixgate.gateway.server.tools.formats import (
    FormatStreamParser,
    format_for_template,
    get_format,
    tool_call_formats,
)
from prefixgate.gateway.server.tools.parser import CallEnd, TextPiece
from prefixgate.gateway.server.tools.records import FunctionTool, ToolChoice
from tests.family_fixtures import template

WEATHER = FunctionTool(
    "get_weather",
    "Weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
     "required": ["city", "days"]},
)  # fmt: skip
ARGS = {"city": "Paris", "days": 3}
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    "\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "mistral_nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}'
    ', "id": "abc123XYZ"}]',
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}
TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_coder",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3_json",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral_nemo",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek_r1",
    "microsoft-Phi-3.5-mini-instruct.jinja": None,
    "google-gemma-2-2b-it.jinja": None,
    "HuggingFaceTB-SmolLM3-3B.jinja": None,  # renders no tools: the gateway's Hermes prompt
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "granite",
    "ibm-granite-granite-4.0.jinja": "hermes",
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_format_is_picked_from_the_template(name):
    fmt = format_for_template(template(name))
    assert (fmt.name if fmt else None) == TEMPLATES[name]
    assert format_for_template(template(name), override="hermes") is get_format("hermes")


@pytest.mark.parametrize(
    "name",
    [
        "Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "unsloth-mistral-Devstral-Small-2507.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    ],
)  # fmt: skip
def test_a_call_the_template_renders_parses_back(name):
    history = [
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call12345", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call12345", "content": "sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {
        "name": WEATHER.name, "description": WEATHER.description, "parameters": WEATHER.schema}}]
    rendered = ChatTemplate(template(name), bos_token="<s>", eos_token="</s>").render(
        history, tools=tools
    )
    fmt = format_for_template(template(name))
    start = rendered.rindex(fmt.trigger)
    end = fmt.find_call(rendered, start)
    assert end is not None
    call = fmt.parse_call(rendered[start:end], [WEATHER])
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == ARGS


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("mode", ["auto", "required", "function"])
def test_grammar_accepts_its_own_call_only(name, mode):
    fmt = get_format(name)
    choice = ToolChoice(mode, "get_weather" if mode == "function" else None)
    spec = fmt.grammar([WEATHER], choice)
    grammar = Grammar.from_structural_tag(spec.source)
    prefix = "Let me check. " if mode == "auto" else ""
    assert _is_grammar_accept_string(grammar, prefix + CALLS[name])
    for other, text in CALLS.items():
        if other != name and mode != "auto":
            assert not _is_grammar_accept_string(grammar, text), other
    wrong = CALLS[name].replace("Paris", "12").replace('"days": 3', '"days": "x"')
    if name != "qwen3_coder":  # raw XML strings may be digits
        assert not _is_grammar_accept_string(grammar, prefix + wrong)
    assert fmt.grammar([WEATHER], ToolChoice("none")) is None


@pytest.mark.parametrize("name", sorted(CALLS))
def test_stream_parses_like_whole(name):
    fmt = get_format(name)
    text = "Checking the weather. " + CALLS[name] + fmt.separator + CALLS[name]
    content, calls = fmt.parse(text, [WEATHER])
    assert content == "Checking the weather. " + fmt.separator
    assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [
        ("get_weather", ARGS, True)
    ] * 2
    parser = FormatStreamParser(fmt, [WEATHER])
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == content
    streamed = [e.call for e in events if isinstance(e, CallEnd)]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_a_call_cut_by_max_tokens_is_reported_incomplete():
    fmt = get_format("hermes")
    _, calls = fmt.parse(CALLS["hermes"][:30])
    assert len(calls) == 1 and not calls[0].complete


def test_registry_lists_the_formats():
    assert set(tool_call_formats()) >= {"hermes", "llama3_json", "qwen3_coder"}


def test_reasoning_split_whole_and_streamed_and_a_call_after_it():
    from prefixgate.gateway.server.tools.formats.reasoning import (
        THINK,
        ReasoningSplitter,
        reasoning_for_template,
        split_reasoning,
        starts_inside,
    )

    assert reasoning_for_template(template("Qwen-Qwen3-0.6B.jinja")).name == "think"
    assert reasoning_for_template(template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))
    assert reasoning_for_template(template("meta-llama-Llama-3.1-8B-Instruct.jinja")) is None
    text = "<think>\nThe user wants weather; call the tool.\n</think>\n\n" + CALLS["hermes"]
    reasoning, content = split_reasoning(text)
    assert reasoning == "\nThe user wants weather; call the tool.\n"
    # a call right after the think block is still a call (vllm#39056)
    assert [c.name for c in get_format("hermes").parse(content, [WEATHER])[1]] == ["get_weather"]
    splitter = ReasoningSplitter()
    pieces = [splitter.feed(ch) for ch in text] + [splitter.finish()]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == (reasoning, content)
    # DeepSeek R1's prompt opens the span; no span at all is all content
    r1 = ChatTemplate(template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))
    hi = [{"role": "user", "content": "hi"}]
    assert starts_inside(THINK, r1.render(hi, enable_thinking=True))
    assert not starts_inside(THINK, r1.render(hi, enable_thinking=False))  # it closes the span
    assert split_reasoning("plan</think>answer", starts_inside=True) == ("plan", "answer")
    assert split_reasoning("just an answer <think> here") == ("", "just an answer <think> here")
    assert split_reasoning("<think>cut short") == ("cut short", "")


def test_mistral_nemo_writes_parallel_calls_in_one_list_as_its_template_does():
    """Nemo's calls of one turn share a ``[TOOL_CALLS][...]`` list: the grammar writes the
    list the template re-renders (ids included), parallel or not; the parser reads it back,
    whole and streamed, and takes a list without ids or with string arguments too."""
    fmt = get_format("mistral_nemo")
    paris, rome = ({"city": c, "days": d} for c, d in (("Paris", 3), ("Rome", 1)))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": a}}
                   for i, a in (("abc123XYZ", paris), ("def456UVW", rome))]},
               {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny"}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": WEATHER.name, "parameters": WEATHER.schema}}]
    rendered = ChatTemplate(template("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
                            bos_token="<s>", eos_token="</s>").render(history, tools=tools)
    written = rendered[rendered.index("[TOOL_CALLS]") : rendered.index("</s>")]
    for parallel, accepted in ((True, True), (False, False)):
        spec = fmt.grammar([WEATHER], ToolChoice("required", None, parallel))
        assert _is_grammar_accept_string(Grammar.from_structural_tag(spec.source),
                                         written) is accepted
    content, calls = fmt.parse("Sure. " + written, [WEATHER])
    assert content == "Sure. "
    assert [(c.id, json.loads(c.arguments)) for c in calls] == [
        ("abc123XYZ", paris), ("def456UVW", rome)]
    parser = FormatStreamParser(fmt, [WEATHER])
    events = [e for ch in written for e in parser.feed(ch)] + parser.finish()
    assert [e.call for e in events if isinstance(e, CallEnd)] == calls
    loose = '[TOOL_CALLS] [{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]'
    (call,) = fmt.parse(loose, [WEATHER])[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    assert call.id.startswith("call_")  # no id written: one is made
    assert fmt.parse("[TOOL_CALLS][1, 2]") == ("[TOOL_CALLS][1, 2]", [])  # not calls: text
