"""The runaway-repeat guard (gateway/server/tools/repeats.py): an exact repeat of a call ends
the turn; a turn without one gives exactly the parser's events, however the text is split."""

from __future__ import annotations

import pytest

from prefixgate.gateway.server.tools.formats.base import FormatStreamParser
from prefixgate.gateway.server.tools.formats.hermes import HERMES
from prefixgate.gateway.server.tools.formats.qwen3_coder import QWEN3_CODER
from prefixgate.gateway.server.tools.parser import CallArguments, CallEnd, CallStart, ToolCallParser
from prefixgate.gateway.server.tools.records import FunctionTool
from prefixgate.gateway.server.tools.repeats import GuardedParser


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris"}')
# outputs of the default model (greedy), and the shapes around them
NO_REPEAT = [
    PARIS,
    PARIS + "\n" + call("get_weather", '{"city": "London"}'),
    PARIS + "\n" + call("get_weather", '{"city": "Paris, TX"}'),  # an earlier call's prefix
    PARIS + "\n" + call("get_time", '{"city": "Paris"}'),  # same arguments, other function
    "Let me check.\n" + PARIS + "\nDone.",
    PARIS + "\n" + call("get_weather", '{"city": "Par'),  # cut by max_tokens mid-repeat
]


def events(parser, text: str, step: int) -> list:
    out = []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        if isinstance(parser, GuardedParser):
            out += parser.feed(piece, i == len(pieces) - 1)
        else:
            out += parser.feed(piece) + (parser.finish() if i == len(pieces) - 1 else [])
    return out


def key(event):  # call ids are random: compare everything else
    if isinstance(event, CallStart):
        return ("start", event.index, event.name)
    if isinstance(event, CallEnd):
        c = event.call
        return ("end", c.index, c.name, c.arguments, c.complete)
    return event


@pytest.mark.parametrize("text", NO_REPEAT)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_turn_without_a_repeat_is_unchanged(text, step):
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1))
    assert [key(e) for e in events(guarded, text, step)] == [
        key(e) for e in events(ToolCallParser(), text, step)]
    assert not cuts and not guarded.repeated


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_the_first_exact_repeat_ends_the_turn(step):
    text = PARIS + "\n" + call("get_weather", '{"city": "London"}') + ("\n" + PARIS) * 5
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1))
    out = events(guarded, text, step)
    assert cuts == [1] and guarded.repeated
    assert [(c.name, c.arguments) for c in guarded.calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "London"}')]
    assert [key(e) for e in out if isinstance(e, CallStart)] == [
        ("start", 0, "get_weather"), ("start", 1, "get_weather")]
    assert guarded.finish_reason("length") == "stop"


def test_without_a_guard_every_call_passes():
    guarded = GuardedParser(None)  # n > 1 choices
    events(guarded, PARIS + "\n" + PARIS, 5)
    assert len(guarded.calls) == 2 and not guarded.repeated
    assert guarded.finish_reason("length") == "length"


# The default model's greedy output with max_tokens 64 (issue 37): the repeat's closing tag is
# cut one token short of its ">", so the parser's final flush reports it as a cut call whose
# arguments are whole.
CUT_IN_CLOSE = PARIS + "\n" + PARIS[:-1]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_repeat_cut_inside_its_closing_tag_ends_the_turn(step):
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1))
    out = events(guarded, CUT_IN_CLOSE, step)
    assert cuts == [1] and guarded.repeated
    assert [(c.name, c.arguments, c.complete) for c in guarded.calls] == [
        ("get_weather", '{"city": "Paris"}', True)]
    assert [key(e) for e in out if isinstance(e, (CallStart, CallEnd))] == [
        ("start", 0, "get_weather"), ("end", 0, "get_weather", '{"city": "Paris"}', True)]
    assert guarded.finish_reason("length") == "stop"


def test_a_repeat_ends_the_turn_once_its_arguments_are_whole():
    # the arguments object closed ("}}" closes it and the call's JSON): only the closing tag can
    # follow, so the engine is told to stop before it spends tokens on it
    whole_arguments = PARIS[: PARIS.index("}}") + 2]
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1))
    assert [key(e) for e in guarded.feed(PARIS + "\n" + whole_arguments)] == [
        ("start", 0, "get_weather"), CallArguments(0, '{"city": "Paris"}'),
        ("end", 0, "get_weather", '{"city": "Paris"}', True)]
    assert cuts == [1] and guarded.repeated
    assert guarded.feed("\n</tool_call>", final=True) == []


def test_a_cut_call_that_only_starts_like_an_earlier_one_is_released():
    text = PARIS + "\n" + PARIS[: PARIS.index('"}}') + 1]  # cut before the object closes
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1))
    out = events(guarded, text, 1)
    assert not cuts and not guarded.repeated
    assert [(c.arguments, c.complete) for c in guarded.calls] == [
        ('{"city": "Paris"}', True), ('{"city": "Paris"', False)]
    assert [key(e) for e in out] == [key(e) for e in events(ToolCallParser(), text, 1)]


QWEN_PARIS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "</function>\n</tool_call>")


@pytest.mark.parametrize(("fmt", "one_call"), [(QWEN3_CODER, QWEN_PARIS), (HERMES, PARIS)])
@pytest.mark.parametrize("cut", [1, 5])
def test_a_format_parsers_repeat_cut_inside_its_end_marker_ends_the_turn(fmt, one_call, cut):
    # the other formats' parser (formats/base.py) restores the end marker of a call cut inside
    # it, so the repeat guard sees whole arguments (before, a nameless empty call came out)
    tools = [FunctionTool("get_weather", parameters={
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]
    cuts = []
    guarded = GuardedParser(lambda: cuts.append(1), parser=FormatStreamParser(fmt, tools))
    events(guarded, one_call + "\n" + one_call[:-cut], 4)
    assert cuts == [1] and guarded.repeated
    assert [(c.name, c.arguments) for c in guarded.calls] == [("get_weather", '{"city": "Paris"}')]
    alone = FormatStreamParser(fmt, tools)  # without the guard: the cut call, named and whole
    cut_call = (alone.feed(one_call[:-cut]) + alone.finish())[-1]
    assert isinstance(cut_call, CallEnd)
    assert (cut_call.call.name, cut_call.call.arguments, cut_call.call.complete) == (
        "get_weather", '{"city": "Paris"}', False)
