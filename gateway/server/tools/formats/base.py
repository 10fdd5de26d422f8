"""What one tool-call format is: how a call is written, enforced, found and parsed.

A format (Hermes ``<tool_call>`` JSON, Llama 3.x JSON, Qwen3-Coder XML, ...) is one object with
the text around a call (``begin(name)`` ... ``end``), the content between (JSON or Qwen's XML
parameters, as an xgrammar structural-tag element), the trigger that opens a call in free text,
and a parser for one call's text. From those, this base class builds the grammar for every
``tool_choice`` and parses outputs, whole or streamed, into the neutral calls every API
surface emits (tools/parser.py's events). The model's own chat template renders tools and
history; a format only has to read and enforce what that template taught the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.api import GrammarSpec
from prefixgate.gateway.server.tools.grammar import schema_grammar, tool_grammar
from prefixgate.gateway.server.tools.parser import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    TextPiece,
    new_call_id,
)
from prefixgate.gateway.server.tools.records import FunctionTool, ToolCallOutput, ToolChoice


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call as written: its name and its arguments as a JSON object text."""

    name: str
    arguments: str
    id: str | None = None  # the id the model wrote (Mistral's [CALL_ID]); None: we make one


class ToolCallFormat:
    """Subclasses set the class attributes and implement ``detect``, ``begin``, ``content``,
    ``find_call`` and ``parse_call``; registration is ``formats.register_format(instance)``."""

    name: str = ""
    trigger: str = ""  # text that opens a call in free text (a prefix of every begin())
    end: str = ""  # text that closes a call
    separator: str = "\n"  # between parallel calls
    # (open, close) around ALL of a turn's calls when the format writes them as one list
    # (Mistral Nemo's ``[TOOL_CALLS][…]``); None: each call stands alone
    block: tuple[str, str] | None = None
    priority: int = 0  # detection order: higher first (a format whose markers contain another's)
    # the output is in channels (harmony): reasoning, answer and calls are split by this
    # format's own ``stream_parser``, not by a reasoning span and ``FormatStreamParser``
    channels: bool = False

    def detect(self, template: str) -> bool:
        """Whether a chat template teaches this format."""
        raise NotImplementedError

    def begin(self, tool_name: str) -> str:
        """The fixed text before a call's arguments."""
        raise NotImplementedError

    def for_template(self, template: str) -> ToolCallFormat:
        """This format as ``template`` writes it (a variant where templates differ)."""
        return self

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history as the template takes it (default: unchanged)."""
        return messages

    def template_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tool list as the template takes it (default: unchanged)."""
        return tools

    def content(self, tool: FunctionTool, param: str = "tools", scope: str = "") -> dict[str, Any]:
        """The structural-tag element of a call's arguments: canonical JSON (``json.dumps``
        spacing, the schema's key order), which is what templates' ``tojson`` re-renders, so
        the next turn's prompt extends this one's tokens. ``param`` names the schema's request
        field in errors; ``scope`` is the tenant (grammar caches are per tenant)."""
        return {"type": "grammar", "grammar": schema_grammar(
            tool.schema, param, strict=tool.strict, object_only=True, scope=scope)}  # fmt: skip

    def find_call(self, text: str, start: int) -> int | None:
        """End offset of the call that begins at ``text[start:]`` (at the trigger); None
        while it is incomplete."""
        close = text.find(self.end, start + len(self.trigger))
        return None if close < 0 else close + len(self.end)

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        """The call in ``call_text`` (trigger to end); None when it is not a well-formed call."""
        raise NotImplementedError

    def parse_calls(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> list[ParsedCall]:
        """Every call in one span from the trigger to its end (formats that wrap several calls
        in one block override this); empty when it is not a well-formed call."""
        call = self.parse_call(call_text, tools)
        return [] if call is None else [call]

    # ---- grammar ---------------------------------------------------------------------------

    def grammar(
        self,
        tools: Sequence[FunctionTool],
        choice: ToolChoice,
        response_format: GrammarSpec | None = None,
        parameters_param: Callable[[int], str] = lambda i: f"tools[{i}].parameters",
        scope: str = "",
    ) -> GrammarSpec | None:
        """A structural-tag grammar enforcing calls in this format for ``choice``
        (tools/grammar.py ``tool_grammar``, with this format's text around each call)."""
        return tool_grammar(tools, choice, response_format, parameters_param, scope, fmt=self)

    # ---- parsing ---------------------------------------------------------------------------

    def parse(
        self, text: str, tools: Sequence[FunctionTool] = ()
    ) -> tuple[str, list[ToolCallOutput]]:
        """``(content, calls)`` of a whole output."""
        parser = FormatStreamParser(self, tools)
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, TextPiece))
        return content, [e.call for e in events if isinstance(e, CallEnd)]


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for size in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-size:]):
            return size
    return 0


class FormatStreamParser:
    """Feed a choice's text as it streams; get tools/parser.py's events. Text streams as it
    comes (holding back what may be the start of a trigger); a call is emitted once its end
    is seen, arguments in one piece."""

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[FunctionTool] = ()) -> None:
        self.format = fmt
        self.tools = tools
        self._buffer = ""
        self._in_call = False
        self._calls: list[ToolCallOutput] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.format.trigger)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self.format.trigger)
                    self._emit_text(events, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._emit_text(events, self._buffer[:at])
                self._buffer, self._in_call = self._buffer[at:], True
            end = self.format.find_call(self._buffer, 0)
            if end is None:
                return events
            call_text, self._buffer = self._buffer[:end], self._buffer[end:]
            self._in_call = False
            self._emit_call(events, call_text, complete=True)

    def finish(self) -> list[Event]:
        """Flush at the end of the output: a cut call is still reported (``complete=False``)."""
        events: list[Event] = []
        if self._in_call:
            self._emit_call(events, self._end_restored(self._buffer), complete=False)
        else:
            self._emit_text(events, self._buffer)
        self._buffer, self._in_call = "", False
        return events

    def _end_restored(self, call_text: str) -> str:
        """A call cut inside its end marker, with the rest of the marker put back: the grammar
        writes the marker right after the arguments, so they are whole and the call parses (as
        tools/parser.py recovers a Hermes call cut in its closing tag; the repeat guard,
        tools/repeats.py, then sees its arguments). A call cut earlier is returned as it is."""
        size = _partial_suffix(call_text, self.format.end)
        restored = call_text + self.format.end[size:]
        if size and self.format.parse_calls(restored, self.tools):
            return restored
        return call_text

    @staticmethod
    def _emit_text(events: list[Event], text: str) -> None:
        if text:
            events.append(TextPiece(text))

    def _emit_call(self, events: list[Event], call_text: str, *, complete: bool) -> None:
        parsed = self.format.parse_calls(call_text, self.tools)
        if not parsed:  # not a call after all (unconstrained text): it is content
            if complete:
                self._emit_text(events, call_text)
                return
            parsed = [ParsedCall("", "")]
        for one in parsed:
            call = ToolCallOutput(len(self._calls), one.id or new_call_id(), one.name,
                                  one.arguments, complete=complete)  # fmt: skip
            self._calls.append(call)
            events += [CallStart(call.index, call.id, call.name),
                       CallArguments(call.index, call.arguments), CallEnd(call)]  # fmt: skip
