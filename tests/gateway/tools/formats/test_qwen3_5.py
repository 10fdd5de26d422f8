"""Qwen3.5 on its real tokenizer (ggml-vocab-qwen35) and its own template (the sdist's
``Qwen3.5-4B.jinja``): Qwen3-Coder's XML calls, a ``<think>`` span the generation prompt opens
unless thinking is off, every ``tool_choice`` enforced on xgrammar with the real vocabulary,
outputs split and parsed whole and streamed, and the history re-rendered as the template's own
(transformers renders the same text) with the reasoning the gateway wrote kept in it."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from prefixgate.engine.api import GrammarSpec
from prefixgate.engine.grammar.compiler import CompileLimits, GrammarCompiler
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.gateway.server.tools.dialect import choose_dialect
from prefixgate.gateway.server.tools.formats.harmony import AnalysisStore
from prefixgate.gateway.server.tools.formats.qwen3_coder import QWEN3_CODER
from prefixgate.gateway.server.tools.formats.reasoning import THINK, thinking_kwargs
from prefixgate.gateway.server.tools.parser import CallEnd, ReasoningPiece, TextPiece
from prefixgate.gateway.server.tools.records import FunctionTool, ToolChoice
from tests.family_fixtures import family_fixture

WEATHER = FunctionTool("get_weather", "The weather forecast", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "daily": {"type": "boolean"}},
    "required": ["city", "days"]})  # fmt: skip
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=daily>\nTrue\n</parameter>\n"
        "</function>\n</tool_call>")
ARGUMENTS = {"city": "Paris", "days": 3, "daily": True}
USER = [{"role": "user", "content": "Weather in Paris?"}]
OPENED = "<|im_start|>assistant\n<think>\n"  # the prompt's end with thinking on (the default)
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # with thinking off
NO_THINKING = thinking_kwargs(False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    hf_dir = family_fixture("qwen3_5").hf_dir
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return Tokenizer.from_hf_files(str(hf_dir / "tokenizer.json"), tokenizer_config=config,
                                   chat_template=(hf_dir / "chat_template.jinja").read_text())


@pytest.fixture(scope="module")
def dialect(tokenizer):
    return choose_dialect(tokenizer.chat_template)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    stops = sorted(set(tokenizer.eos_token_ids) - tokenizer.visible_special_ids)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, stops,
                           limits=CompileLimits(max_workers=0))


def test_the_template_teaches_qwen3_coder_and_opens_the_think_span(tokenizer, dialect):
    # its tool prompt shows <function=…><parameter=…> (and Hermes' <tool_call> around them)
    assert (dialect.format, dialect.native, dialect.reasoning) == (QWEN3_CODER, True, THINK)
    messages, tools = dialect.template_inputs(USER, [WEATHER])
    thinking = tokenizer.render_chat(messages, tools, True)
    assert thinking.endswith("Weather in Paris?<|im_end|>\n" + OPENED)
    assert tokenizer.render_chat(messages, tools, True, **NO_THINKING).endswith(CLOSED)
    assert "You have access to the following functions:\n\n<tools>\n" in thinking
    assert '"name": "get_weather"' in thinking
    assert "described by JSON schemas inside" not in thinking  # not the gateway's prompt


def test_the_prompt_is_the_template_s_own(tokenizer, dialect):
    """Tools, a system prompt, reasoning, parallel calls, tool results, an answer and the next
    question: the gateway renders what transformers renders from the same template."""
    from transformers import PreTrainedTokenizerFast

    hf_dir = family_fixture("qwen3_5").hf_dir
    reference = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps(
                  {"city": city, "days": 2, "daily": False})}}
             for i, city in enumerate(("Paris", "Oslo"))]  # fmt: skip
    history = [
        {"role": "system", "content": "You are a weather agent."}, *USER,
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
         "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "9 C"},
        {"role": "assistant", "content": "Paris is warmer.", "reasoning_content": "Compare."},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    hf_messages = [{**m, "tool_calls": [{**c, "function": {
        "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]} if "tool_calls" in m else m for m in history]
    schema = [{"type": "function", "function": {
        "name": WEATHER.name, "description": WEATHER.description,
        "parameters": WEATHER.schema}}]  # fmt: skip
    for controls in ({}, NO_THINKING):
        ours = tokenizer.render_chat(*dialect.template_inputs(history, [WEATHER]), True,
                                     **controls)
        theirs = reference.apply_chat_template(
            hf_messages, tools=schema, tokenize=False, add_generation_prompt=True,
            chat_template=tokenizer.chat_template.source, **controls)
        assert ours == theirs
    # the parallel calls, the grouped results; the reasoning of turns before the last question
    # is not rendered (the template's design)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=daily>\nFalse\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>") in ours
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C\n"
            "</tool_response><|im_end|>") in ours
    assert "Two cities." not in ours and "<|im_start|>assistant\nParis is warmer." in ours


def _accepts(compiler, tokenizer, spec: GrammarSpec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and \
        matcher.accept_token(tokenizer.token_to_id("<|im_end|>"))


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("mode", ["auto", "required", "function"])
def test_the_grammar_enforces_its_calls_for_every_tool_choice(
        tokenizer, dialect, compiler, mode, thinking):
    tail = OPENED if thinking else CLOSED
    choice = ToolChoice(mode, "get_weather" if mode == "function" else None, parallel=False)
    spec = dialect.grammar([WEATHER], choice, None, lambda i: f"tools[{i}]", prompt_tail=tail)
    assert spec is not None

    def accepts(text: str) -> bool:
        return _accepts(compiler, tokenizer, spec, text)

    # a forced call with the span open closes it, empty, as the template re-renders it
    forced = "\n</think>\n\n" + CALL if thinking else CALL
    assert accepts(forced)
    reasoned = "The user wants Paris.\n</think>\n\n" + CALL
    assert accepts(reasoned) == (mode == "auto")  # auto: free text until a call
    assert accepts("It is sunny.") == (mode == "auto")
    if mode != "auto":
        assert not accepts(forced.replace("Paris", "Paris\n</parameter>\n<parameter=x>"))
        assert not accepts(forced.replace("\n3\n", "\nthree\n"))  # days is an integer
        assert not accepts(forced.replace("True", "true"))  # the template's | string
        # each parameter once, in the schema's order; optional ones may be left out
        assert accepts(forced.replace("<parameter=daily>\nTrue\n</parameter>\n", ""))
        assert not accepts(forced.replace("<parameter=days>\n3\n</parameter>\n", ""))
        assert not accepts(forced + "\n" + CALL)  # parallel_tool_calls false: one call
    assert dialect.grammar([WEATHER], ToolChoice("none"), None, str, prompt_tail=tail) is None


def test_parallel_calls_and_a_json_answer_after_the_opened_span(tokenizer, dialect, compiler):
    both = dialect.grammar([WEATHER], ToolChoice("required"), None, str, prompt_tail=OPENED)
    assert _accepts(compiler, tokenizer, both, "\n</think>\n\n" + CALL + "\n" + CALL)
    # a JSON answer (response_format alone) is written after the span, as the answer
    answer = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"]}))  # fmt: skip
    spec = dialect.grammar([], ToolChoice("auto"), answer, str, prompt_tail=OPENED)
    assert _accepts(compiler, tokenizer, spec, '\n</think>\n\n{"ok": true}')
    assert not _accepts(compiler, tokenizer, spec, '{"ok": true}')
    assert dialect.grammar([], ToolChoice("auto"), answer, str, prompt_tail=CLOSED) is answer
    # a client's own grammar writes the whole output, the span included
    ebnf = GrammarSpec("ebnf", 'root ::= "x"')
    assert dialect.grammar([], ToolChoice("auto"), ebnf, str, prompt_tail=OPENED) is ebnf


def _events(parser, text: str, *, streamed: bool):
    pieces = list(text) if streamed else [text]
    return [e for piece in pieces for e in parser.feed(piece)] + parser.feed("", final=True)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_and_calls_split_whole_and_streamed(dialect, thinking, streamed):
    tail = OPENED if thinking else CLOSED
    output = ("The user wants Paris.\n</think>\n\n" if thinking else "") + CALL
    parser = dialect.parser([WEATHER], None, tail)
    events = _events(parser, output, streamed=streamed)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningPiece))
    assert reasoning == ("The user wants Paris.\n" if thinking else "")
    assert not any(isinstance(e, TextPiece) and e.text.strip() for e in events)
    (call,) = [e.call for e in events if isinstance(e, CallEnd)]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", ARGUMENTS)
    # without tools the span still splits from the answer
    plain = dialect.parser(None, None, tail)
    events = _events(plain, output.replace(CALL, "Sunny."), streamed=streamed)
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == "Sunny."


@pytest.mark.parametrize("sends_reasoning", [True, False])
def test_the_history_keeps_the_reasoning_it_wrote(tokenizer, dialect, sends_reasoning):
    """The template renders the reasoning of every turn after the last user query: the call
    turn's tokens stay a prefix of the next prompt when the client sends the reasoning back
    and, by the gateway keeping what it wrote before the call, when it drops it."""
    prompt = tokenizer.apply_chat_template(*dialect.template_inputs(USER, [WEATHER]))
    output = "The user wants Paris.\n</think>\n\n" + CALL + "<|im_end|>"
    parser = dialect.parser([WEATHER], None, OPENED)
    parser.feed(output.removesuffix("<|im_end|>"), final=True)
    (call,) = parser.calls
    turn = {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}}]}  # fmt: skip
    if sends_reasoning:
        turn["reasoning_content"] = "".join(parser.reasoning)
    history = [*USER, turn, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    following = tokenizer.apply_chat_template(*dialect.template_inputs(history, [WEATHER]))
    generated = prompt + tokenizer.encode(output, add_special_tokens=False)
    assert following[: len(generated)] == generated
    # a call id this process did not write renders as sent: an empty span
    turn = {**turn, "tool_calls": [{**turn["tool_calls"][0], "id": "call_elsewhere"}]}
    turn.pop("reasoning_content", None)
    text = tokenizer.render_chat(*dialect.template_inputs([*USER, turn], [WEATHER]), False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>" in text


def test_the_kept_reasoning_is_bounded_in_entries_and_characters():
    store = AnalysisStore(max_entries=3, max_chars=10)
    for call_id, text in (("a", "12345"), ("b", "1234"), ("c", "12")):
        store.put(call_id, text)
    assert store.get("a") is None and store.get("b") == "1234"  # over 10 characters: a out
    store.put("d", "x" * 11)  # larger than the whole budget: not kept, nothing evicted
    assert store.get("d") is None and store.get("c") == "12"
    for call_id in "efg":
        store.put(call_id, "1")
    assert [store.get(k) for k in "bcefg"] == [None, None, "1", "1", "1"]  # 3 entries at most
