"""The served model's dialect (tools/dialect.py): which format and reasoning span each real
template gets, the override, the one parser every surface takes (a call right after or inside
a think span is a call), the reasoning controls, and how Messages and Responses encode a
reasoning span (a stand-in turn: these are encoders, the live tests run the real model)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from prefixgate.engine.api import Usage
from prefixgate.engine.chat_template import ChatTemplate
from prefixgate.gateway.server.anthropic.writer import MessagesWriter
from prefixgate.gateway.server.responses.schemas import ResponsesRequest
from prefixgate.gateway.server.responses.writer import ResponsesWriter
from prefixgate.gateway.server.settings import TOOL_CALL_FORMATS
from prefixgate.gateway.server.tools import CallEnd, ReasoningPiece, TextPiece
from prefixgate.gateway.server.tools.dialect import ToolDialect, choose_dialect
from prefixgate.gateway.server.tools.formats import tool_call_formats
from prefixgate.gateway.server.tools.formats.reasoning import (
    THINK,
    TemplateKwargs,
    thinking_kwargs,
)
from prefixgate.gateway.server.tools.records import FunctionTool
from prefixgate.gateway.server.turn_stream import ChoiceDelta, ChoiceOutput, OutputSplitter, TurnEnd
from prefixgate.gateway.server.turn_writer import stream_turn
from tests.family_fixtures import template

WEATHER = FunctionTool("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string"}}})  # fmt: skip
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# template → (format, the template renders tools in it, reasoning span)
DIALECTS = {
    "Qwen-Qwen3-0.6B.jinja": ("hermes", True, "think"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", True, None),
    "Qwen3-Coder.jinja": ("qwen3_coder", True, None),
    "Qwen3.5-4B.jinja": ("qwen3_coder", True, "think"),  # its generation prompt opens <think>
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3_json", True, None),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3_json", True, None),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", True, None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral_nemo", True, None),
    # calls in the history, but no tool list: the gateway's Hermes prompt; <think> still splits
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("hermes", False, "think"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("hermes", False, None),
    "google-gemma-2-2b-it.jinja": ("hermes", False, None),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("granite", True, "think"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("hermes", False, "think"),
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate(template(name), bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", DIALECTS)
def test_each_template_gets_its_dialect(name):
    dialect = choose_dialect(_template(name))
    reasoning = dialect.reasoning.name if dialect.reasoning else None
    assert (dialect.format.name, dialect.native, reasoning) == DIALECTS[name]


def test_the_override():
    llama = _template("meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert choose_dialect(llama, "auto") == choose_dialect(llama)
    # hermes on a template that renders tools another way: the gateway writes the prompt
    assert choose_dialect(llama, "hermes") == ToolDialect()
    with pytest.raises(ValueError, match="only in the 'hermes' format"):
        choose_dialect(_template("microsoft-Phi-3.5-mini-instruct.jinja"), "llama3_json")
    assert choose_dialect(None) == ToolDialect()  # no template (a stand-in tokenizer)
    # the CLI's list (it does not import the registry) is the registry's
    assert set(TOOL_CALL_FORMATS) == {"auto", *tool_call_formats()}


def _events(parser, text: str, step: int = 3) -> list:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [e for i, p in enumerate(pieces) for e in parser.feed(p, i == len(pieces) - 1)]


def test_the_parser_splits_reasoning_and_finds_calls_after_and_inside_it():
    dialect = ToolDialect(reasoning=THINK)
    assert ToolDialect().parser(None, None) is None  # no tools, no span: plain text
    after = dialect.parser([WEATHER], None)
    events = _events(after, "<think>\nI should call it.\n</think>\n\n" + HERMES_CALL)
    assert "".join(e.text for e in events if isinstance(e, ReasoningPiece)) == "\nI should call it.\n"
    assert [e.call.name for e in events if isinstance(e, CallEnd)] == ["get_weather"]
    assert not any(isinstance(e, TextPiece) for e in events)
    inside = dialect.parser([WEATHER], None)
    events = _events(inside, f"<think>plan {HERMES_CALL} more</think>The answer")
    assert [json.loads(c.arguments) for c in inside.calls] == [{"city": "Paris"}]
    assert "".join(inside.reasoning) == "plan  more" and "".join(inside.text) == "The answer"
    # a template that opened the span in the prompt (DeepSeek R1): the output starts inside
    opened = dialect.parser(None, None, prompt_tail="<|Assistant|><think>\n")
    _events(opened, "plan</think>answer")
    assert ("".join(opened.reasoning), "".join(opened.text)) == ("plan", "answer")


def test_a_non_hermes_format_parses_through_the_same_seam():
    llama = choose_dialect(_template("meta-llama-Llama-3.1-8B-Instruct.jinja"))
    parser = llama.parser([WEATHER], None)
    _events(parser, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris"})]


def test_reasoning_controls():
    assert thinking_kwargs(None) == {}
    assert thinking_kwargs(None, "none") == {"reasoning_effort": "none",
                                             "enable_thinking": False, "thinking": False}
    assert thinking_kwargs(None, "high")["enable_thinking"] is True
    assert thinking_kwargs(False) == {"enable_thinking": False, "thinking": False}
    with pytest.raises(ValidationError):
        TemplateKwargs.model_validate({"tools": []})  # template variables are the gateway's


class _Turn:
    """A stand-in opened turn: the deltas a model with a think span yields."""

    prompt_ids = [1, 2, 3]

    def __init__(self, items):
        self._items = items

    async def deltas(self):
        for item in self._items:
            yield item

    async def aclose(self):
        pass


def _choice() -> ChoiceOutput:
    choice = ChoiceOutput(0, OutputSplitter())
    choice.content, choice.reasoning, choice.engine_finish = ["Hi"], ["plan"], "stop"
    return choice


def _deltas(*events) -> list:
    """One delta per event, then the end."""
    choice = _choice()
    return [*(ChoiceDelta(0, "", [e], None, None, 0, choice) for e in events),
            TurnEnd(Usage(3, 4, 0), [choice])]


async def _drain(stream) -> list[dict]:
    out = []
    async for chunk in stream:
        for line in chunk.decode().splitlines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def test_messages_stream_a_thinking_block_first():
    turn = _Turn(_deltas(ReasoningPiece("pl"), ReasoningPiece("an"), TextPiece("Hi")))
    events = asyncio.run(_drain(stream_turn(turn, MessagesWriter("msg_1", "m", 16, 3))))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[:2] == [{"type": "thinking_delta", "thinking": "pl"},
                          {"type": "thinking_delta", "thinking": "an"}]


def test_responses_stream_a_reasoning_item_first():
    body = ResponsesRequest.model_validate({"input": "hi", "store": False})
    turn = _Turn(_deltas(ReasoningPiece("plan"), TextPiece("Hi")))
    events = asyncio.run(_drain(stream_turn(turn, ResponsesWriter(None, None, body, [], "m"))))
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.completed")["response"]
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan"}]


def test_mistral_small_writes_and_keeps_its_call_ids():
    dialect = choose_dialect(_template("Mistral-Small-3.2-24B-Instruct-2506.jinja"))
    assert dialect.format.name == "mistral" and dialect.format.call_ids
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from prefixgate.gateway.server.tools.records import ToolChoice

    grammar = Grammar.from_structural_tag(dialect.grammar(
        [WEATHER], ToolChoice("required"), None, lambda i: "tools").source)
    call = '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}'
    assert _is_grammar_accept_string(grammar, call)
    assert not _is_grammar_accept_string(grammar, call.replace("abc123XYZ", "abc_1"))
    parser = dialect.parser([WEATHER], None)
    _events(parser, call)
    assert [(c.id, c.name) for c in parser.calls] == [("abc123XYZ", "get_weather")]
    # the template takes only 9 alphanumerics: ids the client sends back are mapped, stably
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "toolu_abc123XYZ", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}},
                   {"id": "call_8813cc42e25b4e09ac332fc5", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_8813cc42e25b4e09ac332fc5", "content": "x"}]
    messages, _ = dialect.template_inputs(history, [WEATHER])
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert ids[0] == "abc123XYZ" and len(ids[1]) == 9 and ids[1].isalnum()
    assert messages[2]["tool_call_id"] == ids[1]
    assert dialect.template_inputs(history, [WEATHER])[0] == messages
    _template("Mistral-Small-3.2-24B-Instruct-2506.jinja").render(messages)  # no refusal


def test_a_template_without_a_system_turn_gets_the_tools_in_the_first_turn():
    gemma = _template("google-gemma-2-2b-it.jinja")  # it raises on a system turn
    dialect = choose_dialect(gemma)
    assert not dialect.native and not dialect.system_turn
    messages, tools = dialect.template_inputs([{"role": "user", "content": "Weather?"}], [WEATHER])
    assert [m["role"] for m in messages] == ["user"] and tools is None
    assert messages[0]["content"].startswith("# Tools") and messages[0]["content"].endswith(
        "\n\nWeather?")
    assert "get_weather" in gemma.render(messages)


def test_earlier_reasoning_goes_back_to_the_template_from_every_surface():
    from prefixgate.gateway.server.anthropic.schemas import MessagesRequest
    from prefixgate.gateway.server.openai.schemas import ChatCompletionRequest

    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]})
    assert chat.template_messages()[1]["reasoning_content"] == "greet"
    messages = MessagesRequest.model_validate({"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "greet", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Hello"}]}]})
    assert messages.chat_messages()[1] == {"role": "assistant", "content": "Hello",
                                           "reasoning_content": "greet"}
    responses = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "greet"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]})
    assert responses.input_messages()[1]["reasoning_content"] == "greet"
    from prefixgate.gateway.server.responses.schemas import output_messages

    stored = output_messages("", [{"id": "c1"}], "greet")  # what a stored response continues
    assert stored == [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}],
                       "reasoning_content": "greet"}]


def test_granite_sees_its_calls_in_the_history():
    granite = _template("ibm-granite-granite-3.3-2B-Instruct.jinja")
    dialect = choose_dialect(granite)
    call = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    parser = dialect.parser([WEATHER], None)
    _events(parser, call)
    (parsed,) = parser.calls
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": parsed.id,
                "type": "function", "function": {"name": parsed.name,
                                                 "arguments": parsed.arguments}}]},
               {"role": "tool", "tool_call_id": parsed.id, "content": "18 C"}]  # fmt: skip
    messages, tools = dialect.template_inputs(history, [WEATHER])
    assert call in granite.render(messages, tools=tools)  # the template alone would drop it


def test_the_router_hashes_with_the_replicas_dialect():
    from prefixgate.engine.loader.hf import _load_tokenizer
    from prefixgate.gateway.http.auth import KeyTable
    from prefixgate.gateway.router.prompt import PromptHasher
    from tests.family_fixtures import family_fixture

    tokenizer = _load_tokenizer(family_fixture("llama3").hf_dir)
    keys = KeyTable({}, None)
    assert PromptHasher(tokenizer, "m", 16, 0, keys).dialect.format.name == "llama3_json"
    assert PromptHasher(tokenizer, "m", 16, 0, keys, "hermes").dialect == ToolDialect()


def test_mistral_nemo_keeps_its_call_ids_and_takes_a_client_s():
    nemo = _template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
    dialect = choose_dialect(nemo)
    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}]'
    parser = dialect.parser([WEATHER], None)
    _events(parser, call)
    (parsed,) = parser.calls
    assert (parsed.id, parsed.name) == ("abc123XYZ", "get_weather")
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": parsed.id,
                "type": "function", "function": {"name": parsed.name,
                                                 "arguments": parsed.arguments}}]},
               {"role": "tool", "tool_call_id": parsed.id, "content": "18 C"}]  # fmt: skip
    messages, tools = dialect.template_inputs(history, [WEATHER])
    assert call + "</s>" in nemo.render(messages, tools=tools)  # re-rendered as written
    # an OpenAI-style id (the template refuses anything but 9 alphanumerics) is mapped
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_8813cc42e25b4e09ac"
    messages, tools = dialect.template_inputs(history, [WEATHER])
    assert '"call_id": "' + messages[1]["tool_calls"][0]["id"] in nemo.render(messages, tools=tools)
