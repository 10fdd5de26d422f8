"""Harmony (gpt-oss) on its real tokenizer (o200k_harmony, tests/harmony_fixture.py) and the
sdist's gpt-oss template: channels split, calls enforced per tool_choice and parsed whole and
streamed, the stop tokens, reasoning_effort in the system message, the history re-rendered."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from prefixgate.engine.api import GrammarSpec
from prefixgate.engine.grammar.compiler import CompileLimits, GrammarCompiler
from prefixgate.gateway.server.tools.dialect import choose_dialect
from prefixgate.gateway.server.tools.formats.harmony import HARMONY
from prefixgate.gateway.server.tools.formats.reasoning import thinking_kwargs
from prefixgate.gateway.server.tools.parser import CallEnd, ReasoningPiece, TextPiece
from prefixgate.gateway.server.tools.records import FunctionTool, ToolChoice
from tests.harmony_fixture import harmony_tokenizer, tiktoken_harmony

WEATHER = FunctionTool("get_weather", "Weather of a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]})  # fmt: skip
ARGS = '{"city": "Paris", "days": 3}'
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
TEMPLATE_CALL = f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
HARMONY_CALL = (f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                f"{ARGS}<|call|>")
FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"
NEXT = "<|start|>assistant"


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    stops = sorted(set(tokenizer.eos_token_ids) - tokenizer.visible_special_ids)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, stops,
                           limits=CompileLimits(max_workers=0))


def test_the_tokenizer_is_o200k_harmony_and_stops_on_call_and_return(tokenizer):
    text = (f"Hi résumé 12345\n\n  x{NEXT}{TEMPLATE_CALL}<|start|>functions.get_weather "
            'to=assistant<|channel|>commentary<|message|>"sunny"<|end|>')
    assert tokenizer.encode(text) == tiktoken_harmony().encode(text, allowed_special="all")
    ids = {t: tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>")}
    assert ids == {"<|return|>": 200002, "<|call|>": 200012, "<|end|>": 200007}
    assert set(tokenizer.eos_token_ids) == {200002, 199999, 200012}  # <|end|> only ends a message
    # the channel markers stay in the decoded text; other special tokens do not
    decoded = tokenizer.decode(tokenizer.encode(ANALYSIS + "<|reserved_200013|>ok"))
    assert decoded == ANALYSIS + "ok"


def test_the_template_teaches_harmony_and_reasoning_effort_reaches_the_system(tokenizer):
    dialect = choose_dialect(tokenizer.chat_template)
    assert dialect.format is HARMONY and dialect.native
    messages, tools = dialect.template_inputs(
        [{"role": "user", "content": "Weather?"}], [WEATHER])
    high = tokenizer.render_chat(messages, tools, True, **thinking_kwargs(None, "high"))
    assert "Reasoning: high" in high and "type get_weather = (_: {" in high
    assert high.endswith("<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    assert "Reasoning: medium" in tokenizer.render_chat(messages, tools, True)


@pytest.mark.parametrize("mode", ["auto", "required", "function"])
def test_the_grammar_enforces_calls_in_harmony_for_every_tool_choice(tokenizer, compiler, mode):
    choice = ToolChoice(mode, "get_weather" if mode == "function" else None)
    compiled = compiler.compile(HARMONY.grammar([WEATHER], choice))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text))

    assert accepts(TEMPLATE_CALL)
    # forced: the call right away (analysis first could use up max_tokens without it)
    assert accepts(ANALYSIS + NEXT + TEMPLATE_CALL) == (mode == "auto")
    assert not accepts(TEMPLATE_CALL.replace("3}", '"x"}'))  # arguments follow the schema
    assert not accepts(TEMPLATE_CALL + NEXT + TEMPLATE_CALL)  # one call per turn (the template)
    assert accepts(HARMONY_CALL) == (mode == "auto")  # forced: the template's spelling
    assert accepts(ANALYSIS + NEXT + FINAL) == (mode == "auto")
    assert HARMONY.grammar([], ToolChoice("auto")) is None  # no tools, no format: free


def _accepts(tokenizer, compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text))


JSON_FORMAT = GrammarSpec("json_schema", json.dumps(WEATHER.schema))
FINAL_JSON = f"<|channel|>final<|message|>{ARGS}<|return|>"


@pytest.mark.parametrize("tools", [[], [WEATHER]])
def test_a_json_answer_is_written_in_the_final_channel(tokenizer, compiler, tools):
    """Under ``none`` or without tools, a JSON response_format is the final message, right
    away (not bare JSON where gpt-oss writes a channel header), ended by ``<|return|>``."""
    compiled = compiler.compile(HARMONY.grammar(tools, ToolChoice("none"), JSON_FORMAT))
    assert _accepts(tokenizer, compiled, FINAL_JSON)
    assert not _accepts(tokenizer, compiled, ARGS)  # bare JSON
    assert not _accepts(tokenizer, compiled, FINAL_JSON.replace("3}", '"x"}'))  # the schema
    assert not _accepts(tokenizer, compiled, TEMPLATE_CALL)
    assert not _accepts(tokenizer, compiled, ANALYSIS + NEXT + FINAL_JSON)  # right away
    plain = HARMONY.grammar(tools, ToolChoice("none"), GrammarSpec("regex", "a+"))
    assert plain == GrammarSpec("regex", "a+")  # a client's own grammar writes everything


def test_none_with_tools_writes_messages_but_no_call(tokenizer, compiler):
    compiled = compiler.compile(HARMONY.grammar([WEATHER], ToolChoice("none")))
    assert _accepts(tokenizer, compiled, ANALYSIS + NEXT + FINAL)
    assert _accepts(tokenizer, compiled, FINAL)
    assert not _accepts(tokenizer, compiled, TEMPLATE_CALL)
    assert not _accepts(tokenizer, compiled, ANALYSIS + NEXT + TEMPLATE_CALL)
    assert not _accepts(tokenizer, compiled, HARMONY_CALL)


def test_auto_with_a_json_format_constrains_the_final_message(tokenizer, compiler):
    compiled = compiler.compile(HARMONY.grammar([WEATHER], ToolChoice("auto"), JSON_FORMAT))
    assert _accepts(tokenizer, compiled, ANALYSIS + NEXT + FINAL_JSON)
    assert _accepts(tokenizer, compiled, ANALYSIS + NEXT + TEMPLATE_CALL)
    assert not _accepts(tokenizer, compiled, ANALYSIS + NEXT + FINAL)  # free text


def _events(parser, text: str, *, streamed: bool):
    pieces = list(text) if streamed else [text]
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.feed("", final=True)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("call", [TEMPLATE_CALL, HARMONY_CALL])
def test_channels_split_and_calls_parse_whole_and_streamed(tokenizer, streamed, call):
    dialect = choose_dialect(tokenizer.chat_template)
    # the engine does not show the stop token: the text ends at the arguments
    text = ANALYSIS + NEXT + call.removesuffix("<|call|>")
    parser = dialect.parser([WEATHER], None)
    events = _events(parser, text, streamed=streamed)
    assert "".join(parser.reasoning) == "The user wants the weather."
    assert "".join(parser.text) == ""
    (end,) = [e for e in events if isinstance(e, CallEnd)]
    assert end.call.name == "get_weather" and json.loads(end.call.arguments) == json.loads(ARGS)
    assert end.call.complete

    answer = dialect.parser(None, None)  # no tools: analysis is still reasoning
    events = _events(answer, ANALYSIS + NEXT + FINAL.removesuffix("<|return|>"), streamed=streamed)
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == "It is sunny."
    assert "".join(e.text for e in events if isinstance(e, ReasoningPiece)).startswith("The user")


@pytest.mark.parametrize("streamed", [False, True])
def test_the_final_json_answer_is_content_and_a_builtin_recipient_is_no_call(tokenizer,
                                                                            streamed):
    dialect = choose_dialect(tokenizer.chat_template)
    parser = dialect.parser(None, None)
    events = _events(parser, FINAL_JSON.removesuffix("<|return|>"), streamed=streamed)
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == ARGS
    # a model trained on harmony's built-in tools may address one; none is ever declared here
    builtin = ('<|channel|>commentary to=python <|constrain|>code<|message|>print(1)<|call|>')
    parser = dialect.parser([WEATHER], None)
    events = _events(parser, ANALYSIS + NEXT + builtin.removesuffix("<|call|>"),
                     streamed=streamed)
    assert not [e for e in events if isinstance(e, CallEnd)]
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == "print(1)"


def test_unstructured_text_is_content():
    content, calls = HARMONY.parse("Just an answer, no channels.")
    assert content == "Just an answer, no channels." and calls == []


@pytest.mark.parametrize("sends_reasoning", [True, False])
def test_the_history_keeps_the_call_turn_s_analysis(tokenizer, sends_reasoning):
    """A call turn's analysis is re-rendered in place (the template keeps it until a final
    answer follows), sent back as reasoning_content or, by a client that drops it, from what
    the gateway generated before that call: the turn's output stays a prefix."""
    dialect = choose_dialect(tokenizer.chat_template)
    history = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(*dialect.template_inputs(history, [WEATHER]))
    output = ANALYSIS + NEXT + TEMPLATE_CALL
    parser = dialect.parser([WEATHER], None)
    parser.feed(output.removesuffix("<|call|>"), final=True)
    (call,) = parser.calls
    history += [
        {"role": "assistant", "content": "",
         "reasoning_content": "".join(parser.reasoning) if sends_reasoning else None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]  # fmt: skip
    following = tokenizer.apply_chat_template(*dialect.template_inputs(history, [WEATHER]))
    generated = prompt + tokenizer.encode(output)
    assert following[: len(generated)] == generated


def test_a_call_the_gateway_did_not_write_renders_as_sent(tokenizer):
    dialect = choose_dialect(tokenizer.chat_template)
    turn = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_unknown", "type": "function",
        "function": {"name": "get_weather", "arguments": ARGS}}]}  # fmt: skip
    (rendered,) = HARMONY.history_messages([turn])
    assert "thinking" not in rendered
    history = [{"role": "user", "content": "Weather?"}, turn,
               {"role": "tool", "tool_call_id": "call_unknown", "content": "sunny"}]
    text = tokenizer.render_chat(*dialect.template_inputs(history, [WEATHER]))
    assert "<|start|>user<|message|>Weather?<|end|><|start|>assistant to=functions" in text
