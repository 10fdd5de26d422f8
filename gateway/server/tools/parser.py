"""Generated text → content and tool calls, incrementally (streaming) or all at once.

The grammar writes calls as ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``
(tools/prompt.py). The parser turns the text of one choice into events: text before or between
calls, a call's start (index, id, name), pieces of its arguments, and its end. The pieces of a
call's arguments concatenate to exactly its arguments JSON. Whitespace between and after calls
is not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from prefixgate.gateway.server.tools.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from prefixgate.gateway.server.tools.records import ToolCallOutput

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CLOSING = re.compile(r"\s*\}\s*" + re.escape(TOOL_CALL_CLOSE))
_DECODER = json.JSONDecoder()
MAX_HEADER_CHARS = 4096  # a header that long is not a header (only unconstrained text gets here)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    call: ToolCallOutput


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    """Text of the model's reasoning span (``<think>``), never part of the answer."""

    text: str


Event = TextPiece | CallStart | CallArguments | CallEnd | ReasoningPiece


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for size in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    """Feed a choice's text as it streams; collect events. One parser per choice."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "text"  # text | header | arguments
        self._calls: list[ToolCallOutput] = []
        self._current: CallStart | None = None
        self._sent = 0  # characters of the current call's arguments already emitted
        self._pending_space = ""  # whitespace after a call: content only if text follows

    @property
    def calls(self) -> list[ToolCallOutput]:
        """The calls finished so far, in order."""
        return list(self._calls)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            before = (self._state, len(self._buffer))
            if self._state == "text":
                self._scan_text(events)
            elif self._state == "header":
                self._scan_header(events)
            else:
                self._scan_arguments(events)
            if (self._state, len(self._buffer)) == before:
                return events

    def finish(self) -> list[Event]:
        """The output ended: flush held text; a call cut short ends incomplete."""
        events = self.feed("")
        if self._state == "text":
            if self._buffer:
                self._text(events, self._buffer, final=True)
        elif self._state == "header":
            self._text(events, TOOL_CALL_OPEN + self._buffer, final=True)
        else:
            assert self._current is not None
            try:  # cut inside the closing tag: the arguments themselves are whole
                _, end = _DECODER.raw_decode(self._buffer)
            except json.JSONDecodeError:
                end = -1
            # NOTE: never let the object's closing brace or a partial close tag into arguments
            arguments = self._buffer[:end] if end >= 0 else self._buffer
            if len(arguments) > self._sent:
                events.append(CallArguments(self._current.index, arguments[self._sent :]))
            self._end_call(events, arguments, complete=False)
        self._buffer = ""
        self._state = "text"
        return events

    # ---- states ---------------------------------------------------------------------------

    def _text(self, events: list[Event], text: str, *, final: bool = False) -> None:
        if not text:
            return
        if self._calls or self._current is not None:
            # after a call, whitespace is a separator unless more text follows it
            text = self._pending_space + text
            stripped = text.rstrip()
            self._pending_space = text[len(stripped):]
            if final:
                self._pending_space = ""
            text = stripped
            if not text.strip():
                return
        events.append(TextPiece(text))

    def _scan_text(self, events: list[Event]) -> None:
        at = self._buffer.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._text(events, self._buffer[:at])
            self._pending_space = ""
            self._buffer = self._buffer[at + len(TOOL_CALL_OPEN) :]
            self._state = "header"
            return
        hold = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
        ready = self._buffer[: len(self._buffer) - hold]
        if ready:
            self._text(events, ready)
            self._buffer = self._buffer[len(ready) :]

    def _scan_header(self, events: list[Event]) -> None:
        match = _HEADER.match(self._buffer)
        if match is None:
            if len(self._buffer) > MAX_HEADER_CHARS:  # not a call after all: it was text
                self._text(events, TOOL_CALL_OPEN + self._buffer)
                self._buffer = ""
                self._state = "text"
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            name = match.group(1)
        self._current = CallStart(len(self._calls), new_call_id(), name)
        events.append(self._current)
        self._buffer = self._buffer[match.end() :]
        self._sent = 0
        self._state = "arguments"

    def _scan_arguments(self, events: list[Event]) -> None:
        assert self._current is not None
        if self._sent == 0 and self._buffer[:1].isspace():
            self._buffer = self._buffer.lstrip()  # between "arguments": and the JSON
        buffer = self._buffer
        if TOOL_CALL_CLOSE in buffer:
            try:
                _, end = _DECODER.raw_decode(buffer)
            except json.JSONDecodeError:
                end = -1
            closing = _CLOSING.match(buffer, end) if end >= 0 else None
            if closing is not None:
                if end > self._sent:
                    events.append(CallArguments(self._current.index, buffer[self._sent : end]))
                self._end_call(events, buffer[:end], complete=True)
                self._buffer = buffer[closing.end() :]
                self._state = "text"
                return
        # hold back what may be the end of the call: "}" + whitespace + a prefix of the close tag
        ready = len(buffer)
        brace = buffer.rfind("}")
        if brace >= 0:
            tail = buffer[brace + 1 :].lstrip()
            if TOOL_CALL_CLOSE.startswith(tail):
                ready = brace
        if ready > self._sent:
            events.append(CallArguments(self._current.index, buffer[self._sent : ready]))
            self._sent = ready

    def _end_call(self, events: list[Event], arguments: str, *, complete: bool) -> None:
        assert self._current is not None
        call = ToolCallOutput(self._current.index, self._current.id, self._current.name,
                              arguments if complete else arguments.rstrip(), complete)
        self._calls.append(call)
        events.append(CallEnd(call))
        self._current = None
        self._sent = 0


def parse_output(text: str) -> tuple[str, list[ToolCallOutput]]:
    """All at once: ``(content, calls)``; content is the text outside calls, stripped."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextPiece))
    return content.strip(), parser.calls
