"""Runaway parallel calls: a turn that repeats a call it already made, exactly, is degenerate.

With ``parallel_tool_calls`` on (OpenAI's default) a small model may write
``get_weather({"city": "Paris"})`` again and again until ``max_tokens``; the client then sees a
truncated turn (``length`` / ``incomplete`` / ``max_tokens``). Running the same call twice in one
turn can only return the same answer twice, so the first exact repeat (same function, same
arguments text) ends the turn there: the repeat is dropped, the engine is told to finish the
request (engine/engine_core.py ``finish_early``), and the turn ends with the calls made
before it, as a turn that stopped on its own (``tool_calls`` / ``tool_use`` / completed).

A repeat is known as soon as its arguments are whole, not only at the call's closing tag: the
arguments are a JSON object, so a call whose arguments text already equals an earlier call's
(of the same function) can only close. NOTE: waiting for the closing tag missed the default
model's runaway (issue 37): with ``max_tokens`` 64 its output ends
``..."arguments": {"city": "Paris"}}\n</tool_call`` one token short of the ``>``, so the repeat
came out of the parser's final flush as an incomplete call with whole arguments, was let
through as a second call, and the turn ended ``length``. A call cut by ``max_tokens`` with whole
arguments equal to an earlier call's is a repeat too.

Nothing else changes: a call that may still turn out to be a repeat (its arguments so far are
the prefix of an earlier call's of the same function) is held back until it differs, then
released unchanged (a call cut inside its arguments is released as the cut call it is); a turn
without an exact repeat streams the same events in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.gateway.server.tools.formats.reasoning import ReasoningSplitter
from prefixgate.gateway.server.tools.parser import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    ReasoningPiece,
    TextPiece,
    ToolCallParser,
)
from prefixgate.gateway.server.tools.records import ToolCallOutput


class RepeatGuard:
    """Filters one choice's parser events; ``repeated`` turns True at the first exact repeat."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off: every event passes (n > 1 choices cannot end alone)
        self.calls: list[ToolCallOutput] = []  # the calls let through, in order
        self.repeated = False
        self._made: list[tuple[str, str]] = []  # (name, arguments) of the complete calls
        self._held: list[Event] = []  # the open call's events while it may be a repeat
        self._name = ""
        self._arguments = ""

    def _may_repeat(self) -> bool:
        return self.enabled and any(name == self._name and arguments.startswith(self._arguments)
                   for name, arguments in self._made)

    def _repeats(self, name: str, arguments: str) -> bool:
        """Whether a call with these (whole or partial) arguments is an earlier call again.

        NOTE: arguments are a JSON object (the grammar enforces it), and an object's text ends
        at its closing brace: text equal to a complete earlier call's arguments is whole.
        """
        return self.enabled and arguments.endswith("}") and (name, arguments) in self._made

    def _cut(self) -> None:
        self.repeated = True
        self._held = []

    def _release(self, out: list[Event]) -> None:
        out += self._held
        self._held = []

    def filter(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if self.repeated:
                break  # the turn ended at the repeat: nothing after it is output
            if isinstance(event, CallStart):
                self._name, self._arguments = event.name, ""
                (self._held if self._may_repeat() else out).append(event)
            elif isinstance(event, CallArguments):
                self._arguments += event.text
                if not self._held:
                    out.append(event)
                elif self._repeats(self._name, self._arguments):
                    self._cut()  # whole arguments equal to an earlier call's: only the close is left
                    break
                else:
                    self._held.append(event)
                    if not self._may_repeat():
                        self._release(out)
            elif isinstance(event, CallEnd):
                key = (event.call.name, event.call.arguments)
                # a call cut by max_tokens counts too: equal to a complete call's, its
                # arguments are whole (only its closing tag was cut)
                if self._repeats(*key):
                    self._cut()
                    break
                self._release(out)
                self._made.append(key)
                self.calls.append(event.call)
                out.append(event)
            else:
                out.append(event)
        return out


class _PlainText:
    """The output of a turn without tools: all text (reasoning may still be split from it)."""

    def feed(self, text: str) -> list[Event]:
        return [TextPiece(text)] if text else []

    def finish(self) -> list[Event]:
        return []


class GuardedParser:
    """One choice's output parser: the reasoning span split off (``splitter``), the tool-call
    parser of the model's format (``parser``; default the gateway's Hermes
    :class:`ToolCallParser`; :class:`_PlainText` for a turn without tools), and a
    :class:`RepeatGuard`: ``on_repeat`` is called once, at the first exact repeat (end the
    engine request there; None = no guard). The text outside calls is kept in ``text``, the
    reasoning in ``reasoning``; ``remember(call_id, reasoning)`` is told the reasoning written
    before each complete call (tools/dialect.py keeps it for the history).

    NOTE: calls are found in the whole output, reasoning span included, and the span is split
    from the text around them: a call written inside or right after ``<think>`` is a call.
    """

    def __init__(self, on_repeat: Callable[[], None] | None, parser: Any = None,
                 splitter: ReasoningSplitter | None = None,
                 remember: Callable[[str, str], None] | None = None) -> None:
        self._parser = parser if parser is not None else ToolCallParser()
        self._splitter = splitter
        self._remember = remember
        self._guard = RepeatGuard(enabled=on_repeat is not None)
        self._on_repeat = on_repeat
        self.text: list[str] = []
        self.reasoning: list[str] = []

    @property
    def calls(self) -> list[ToolCallOutput]:
        return list(self._guard.calls)

    @property
    def repeated(self) -> bool:
        return self._guard.repeated

    def feed(self, text: str, final: bool = False) -> list[Event]:
        """Events for ``text`` (``final``: the output ended; flush what the parser holds)."""
        if self._guard.repeated:
            return []
        events = self._parser.feed(text)
        if final:
            events += self._parser.finish()
        if self._splitter is not None:
            events = self._split(events, final)
        out = self._guard.filter(events)
        for event in out:
            if isinstance(event, TextPiece):
                self.text.append(event.text)
            elif isinstance(event, ReasoningPiece):
                self.reasoning.append(event.text)
            elif isinstance(event, CallEnd) and self._remember is not None:
                self._remember_call(event.call)
        if self._guard.repeated and self._on_repeat is not None:
            self._on_repeat()
        return out

    def _remember_call(self, call: ToolCallOutput) -> None:
        reasoning = "".join(self.reasoning).strip("\n")
        if call.complete and reasoning.strip() and self._remember is not None:
            self._remember(call.id, reasoning)

    def _split(self, events: list[Event], final: bool) -> list[Event]:
        assert self._splitter is not None
        out: list[Event] = []
        pieces = [self._splitter.feed(e.text) if isinstance(e, TextPiece) else e for e in events]
        if final:
            pieces.append(self._splitter.finish())
        for piece in pieces:
            if not isinstance(piece, tuple):
                out.append(piece)
                continue
            reasoning, content = piece
            if reasoning:
                out.append(ReasoningPiece(reasoning))
            if content:
                out.append(TextPiece(content))
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The engine's reason, except a turn cut at a repeat stopped (it may have run on to
        ``length`` before the engine saw the cut)."""
        if self._guard.repeated and engine_reason is not None:
            return "stop"
        return engine_reason
