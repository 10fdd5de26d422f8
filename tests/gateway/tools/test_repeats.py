"""The runaway-repeat guard (gateway/server/tools/repeats.py): an exact repeat of a call ends
the turn; a turn without one gives exactly the parser's events, however the text is split."""

from __future__ import annotations

import pytest

from prefixgate.gateway.server.tools.parser import CallEnd, CallStart, ToolCallParser
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
