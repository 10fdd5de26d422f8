"""gateway/server/tools/parser.py: generated text → content and calls, in any chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.gateway.server.tools.parser import (
    CallArguments,
    CallEnd,
    CallStart,
    TextPiece,
    ToolCallParser,
    parse_output,
)
from prefixgate.gateway.server.tools.prompt import CALL_END, render_call

CLOSING = CALL_END

CALLS = [("get_weather", {"city": "Pa}ris </tool_call>", "n": {"a": [1, "}"]}}), ("noop", {})]
TEXT = "Let me check.\n" + "\n".join(render_call(n, a) for n, a in CALLS) + "\n"


def run(chunks: list[str]):
    parser = ToolCallParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    return parser, events


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_any_chunking_gives_the_same_content_and_calls(cuts):
    parser, events = run(split(TEXT, cuts))
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == "Let me check.\n"
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "noop")]
    pieces: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            pieces[e.index] = pieces.get(e.index, "") + e.text
    # the streamed pieces concatenate to exactly the arguments JSON, which is the call's
    assert [json.loads(pieces[i]) for i in range(2)] == [a for _, a in CALLS]
    assert [c.arguments for c in parser.calls] == [pieces[0], pieces[1]]
    assert all(c.complete for c in parser.calls)
    assert len({c.id for c in parser.calls}) == 2
    assert all(c.id.startswith("call_") for c in parser.calls)
    # a call starts before its arguments and ends after them
    order = [type(e).__name__ for e in events if not isinstance(e, TextPiece)]
    assert order[0] == "CallStart" and order[-1] == "CallEnd"


def test_text_without_calls_is_content_even_with_a_tag_like_prefix():
    assert parse_output("a <tool_response> b <tool_ca") == ("a <tool_response> b <tool_ca", [])


def test_a_call_cut_by_max_tokens_is_incomplete():
    content, calls = parse_output('Sure <tool_call>\n{"name": "f", "arguments": {"x": "ab')
    assert content == "Sure"
    assert len(calls) == 1 and not calls[0].complete
    assert calls[0].name == "f" and calls[0].arguments == '{"x": "ab'


@pytest.mark.parametrize("cut", range(1, len(CLOSING) + 1))
def test_a_call_cut_inside_its_closing_keeps_only_its_arguments(cut):
    """max_tokens inside ``}\n</tool_call>``: the arguments are whole, nothing of the closing
    leaks into them, streamed or not."""
    call = render_call("f", {"x": {"y": 1}})
    text = call[: len(call) - cut]
    for chunks in ([text], list(text)):
        parser, events = run(chunks)
        streamed = "".join(e.text for e in events if isinstance(e, CallArguments))
        assert streamed == parser.calls[0].arguments == '{"x": {"y": 1}}'
        assert not parser.calls[0].complete


def test_a_header_cut_short_stays_text():
    assert parse_output('<tool_call>\n{"name": "ge') == ('<tool_call>\n{"name": "ge', [])


def test_text_after_calls_is_content_but_separators_are_not():
    parser, events = run([render_call("f", {}), "\n \n", render_call("g", {"a": 1}), "\n\nDone."])
    assert [e.text for e in events if isinstance(e, TextPiece)] == ["\n\nDone."]
    assert [c.name for c in parser.calls] == ["f", "g"]
    assert [e.call.index for e in events if isinstance(e, CallEnd)] == [0, 1]


def test_escaped_names_are_decoded():
    _, calls = parse_output(render_call('we"ird', {}))
    assert calls[0].name == 'we"ird'
