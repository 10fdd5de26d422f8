"""Harmony (gpt-oss): a turn is a run of messages, each in a channel.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the generation prompt ends with ``<|start|>assistant``, so the first message's header follows
it directly). ``analysis`` is reasoning (``reasoning_content``, Responses ``reasoning`` items,
Anthropic ``thinking``); ``commentary`` addressed ``to=functions.NAME`` is a call; ``final`` is
the answer (a ``commentary`` message without a recipient is a preamble the user sees: content).
``<|call|>`` and ``<|return|>`` end generation, ``<|end|>`` only a message
(engine/tokenizer.py keeps the markers in the decoded text and stops on those two).

A call's header comes in two spellings: the one gpt-oss's chat template re-renders in the
history (``to=`` in the role, ``<|channel|>commentary json``) and harmony's own renderer's
(``<|channel|>commentary to=functions.NAME <|constrain|>json``). The parser reads both. The
grammar lets the model pick under ``auto`` and writes the template's spelling when it chooses
(``required``, a named function): that is what the next turn's prompt re-renders, so the turn's
tokens stay a prefix of the next prompt. The template renders one call per assistant turn
(``tool_calls[0]``), so a turn makes one call (``parallel_tool_calls`` cannot add more).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from prefixgate.engine.api import GrammarSpec
from prefixgate.engine.grammar.schema_bounds import has_regex
from prefixgate.gateway.server.tools.formats.base import ParsedCall, ToolCallFormat
from prefixgate.gateway.server.tools.formats.registry import register_format
from prefixgate.gateway.server.tools.grammar import schema_grammar, tool_grammar
from prefixgate.gateway.server.tools.parser import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    ReasoningPiece,
    TextPiece,
    new_call_id,
)
from prefixgate.gateway.server.tools.records import FunctionTool, ToolCallOutput, ToolChoice

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
NEXT_MESSAGE = START + "assistant"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_BODY_ENDS = (END, CALL, RETURN, START)  # what closes a message body (START: a model that
# skipped <|end|>)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
MAX_HEADER_CHARS = 512  # a header is a role, a channel and a recipient: more is not a header


def template_call_header(name: str) -> str:
    """A call's header as gpt-oss's template re-renders it (after ``<|start|>assistant``)."""
    return f" to=functions.{name}{CHANNEL}commentary json{MESSAGE}"


def harmony_call_header(name: str) -> str:
    """A call's header as harmony's renderer writes it (the spelling gpt-oss was trained on)."""
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


class AnalysisStore:
    """The analysis each call was written after, by the call's id, so that a call turn sent
    back without its reasoning (an OpenAI chat client drops ``reasoning_content``) is
    re-rendered with it, as generated: the template keeps a call turn's analysis until a final
    answer follows, so the turn's tokens stay a prefix of the next prompt (docs/tool-formats.md
    "Harmony and the cache"). NOTE: keyed by the gateway's call ids (96 random bits, seen only
    by the client that got the call); bounded in entries and in characters (a reasoning span
    may run to thousands of tokens), least recently used first out; in-process (on another
    replica the turn renders as the client sent it: a cache miss, never a wrong prompt)."""

    def __init__(self, max_entries: int = 65536, max_chars: int = 64 << 20) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, call_id: str, analysis: str) -> None:
        with self._lock:
            old = self._entries.pop(call_id, None)
            self._chars -= len(old) if old is not None else 0
            if len(analysis) > self.max_chars:
                return  # would evict everything else and not fit
            self._entries[call_id] = analysis
            self._chars += len(analysis)
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                self._chars -= len(self._entries.popitem(last=False)[1])

    def get(self, call_id: str) -> str | None:
        with self._lock:
            analysis = self._entries.get(call_id)
            if analysis is not None:
                self._entries.move_to_end(call_id)
            return analysis


ANALYSES = AnalysisStore()


class HarmonyFormat(ToolCallFormat):
    name = "harmony"
    trigger = " to=functions."
    end = CALL
    separator = NEXT_MESSAGE
    channels = True  # reasoning and answer are channels: this format's parser splits them
    priority = 20

    def detect(self, template: str) -> bool:
        return CHANNEL in template and CALL in template and "to=" in template

    def begin(self, tool_name: str) -> str:
        return template_call_header(tool_name)

    def history_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The template reads an assistant turn's reasoning as ``thinking`` (and refuses a call
        turn with both ``content`` and ``thinking``: a preamble joins the reasoning)."""
        out = []
        for message in messages:
            reasoning = message.get("reasoning_content") or _generated_analysis(message)
            if message.get("role") == "assistant" and reasoning:
                message = {k: v for k, v in message.items() if k != "reasoning_content"}
                if message.get("tool_calls") and message.get("content"):
                    reasoning = f"{reasoning}\n\n{message['content']}"
                    message["content"] = ""
                message["thinking"] = reasoning
            out.append(message)
        return out

    def template_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """gpt-oss's template writes ``"// " + description`` for every tool: one without a
        description (optional on every surface) gets an empty one instead of a 400."""
        return [{**t, "function": {"description": "", **t["function"]}} for t in tools]

    def parse_call(self, call_text: str, tools: Sequence[FunctionTool] = ()) -> ParsedCall | None:
        """One call message (header, ``<|message|>``, arguments)."""
        header, _, body = call_text.partition(MESSAGE)
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            return None
        for marker in (CALL, END, RETURN):
            body = body.removesuffix(marker)
        return ParsedCall(recipient.group(1).removeprefix("functions."), body.strip())

    # ---- grammar ---------------------------------------------------------------------------

    def grammar(
        self,
        tools: Sequence[FunctionTool],
        choice: ToolChoice,
        response_format: GrammarSpec | None = None,
        parameters_param: Callable[[int], str] = lambda i: f"tools[{i}].parameters",
        scope: str = "",
    ) -> GrammarSpec | None:
        """Harmony's message structure with calls in it, per ``tool_choice``:

        * ``auto``: messages separated by ``<|start|>assistant``: analysis, final, calls in
          either header spelling; at most one call, which ends the turn (``<|call|>``); with a
          JSON ``response_format`` the final message's content follows it;
        * ``required`` / a function: the call, right away, in the template's spelling (as
          every format's forced call: analysis first could run to ``max_tokens`` and leave the
          turn without the call it must have);
        * ``none`` with tools: the messages of ``auto`` without calls (analysis, preambles, the
          final answer);
        * a JSON ``response_format`` under ``none`` or without tools: the final message right
          away, ``<|channel|>final<|message|>`` + the JSON + ``<|return|>``, as the forced call
          (and as a reasoning span is closed empty before a JSON answer, tools/dialect.py):
          the answer lands in the channel every surface shows as content;
        * no tools and no JSON format: free (the parser splits whatever channels it writes); a
          client's own regex / EBNF / choice grammar writes the whole output, as elsewhere.
        """
        json_format = response_format if _is_json(response_format) else None
        if tools and choice.mode != "none":
            one = ToolChoice(choice.mode, choice.name, parallel=False)
            spec = tool_grammar(tools, one, None, parameters_param, scope, fmt=self)
            assert spec is not None
            if choice.mode != "auto":
                return spec
            return _auto(spec, tools, scope, parameters_param, self, json_format)
        if json_format is not None:
            final = {"type": "tag", "begin": f"{CHANNEL}final{MESSAGE}",
                     "content": _format_of(json_format, scope), "end": RETURN}
            return _wrap(_json_spec(json_format), final)
        if tools and response_format is None:  # none: no calls, the answer in messages
            grammar = {"type": "tags_with_separator", "tags": _messages(),
                       "separator": NEXT_MESSAGE, "at_least_one": True}
            return _wrap(GrammarSpec("structural_tag", param="tool_choice",
                                     forced_text_finite=True), grammar)
        return response_format

    # ---- parsing ---------------------------------------------------------------------------

    def stream_parser(self, tools: Sequence[FunctionTool] | None) -> HarmonyParser:
        return HarmonyParser(tools or ())

    def parse(self, text: str, tools: Sequence[FunctionTool] = ()
              ) -> tuple[str, list[ToolCallOutput]]:
        parser = HarmonyParser(tools)
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, TextPiece))
        return content, [e.call for e in events if isinstance(e, CallEnd)]


def _generated_analysis(message: dict[str, Any]) -> str | None:
    """The analysis this gateway generated before an assistant turn's call, when the client
    sent the turn back without it (and without a preamble, which would take its place)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls or message.get("content"):
        return None
    call_id = calls[0].get("id") if isinstance(calls[0], dict) else None
    return ANALYSES.get(call_id) if isinstance(call_id, str) else None


_ANALYSIS_TEXT = {"type": "any_text", "excludes": [m for m in MARKERS if m != END]}


def _analysis_tag(end: str | list[str] = END) -> dict[str, Any]:
    return {"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}", "content": _ANALYSIS_TEXT,
            "end": end}


def _wrap(spec: GrammarSpec, grammar: dict[str, Any]) -> GrammarSpec:
    source = json.dumps({"type": "structural_tag", "format": grammar}, ensure_ascii=False)
    return GrammarSpec("structural_tag", source, param=spec.param,
                       forced_text_finite=spec.forced_text_finite)


def _is_json(spec: GrammarSpec | None) -> bool:
    return spec is not None and spec.kind in ("json_schema", "json_object")


def _format_of(response_format: GrammarSpec, scope: str) -> dict[str, Any]:
    """A JSON ``response_format`` as a structural-tag element (tools/grammar.py's schema
    grammar: canonical JSON, the 400 naming the field for a bad schema)."""
    if response_format.kind == "json_object":
        return {"type": "grammar", "grammar": schema_grammar(
            {"type": "object"}, response_format.param, strict=False, scope=scope)}
    return {"type": "grammar", "grammar": schema_grammar(
        json.loads(response_format.source), response_format.param,
        strict=response_format.strict, scope=scope)}  # fmt: skip


def _json_spec(response_format: GrammarSpec) -> GrammarSpec:
    """The parameters of a grammar that wraps a JSON ``response_format`` (its field for
    errors; whether every text it can force is finite, as tools/grammar.py judges a schema)."""
    schema = json.loads(response_format.source) if response_format.kind == "json_schema" else {}
    return GrammarSpec("structural_tag", param=response_format.param,
                       forced_text_finite=not has_regex(schema))


def _messages(final_content: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Harmony's non-call messages: analysis, the final answer (its content free text, or
    ``final_content``), a commentary preamble."""
    text = {"type": "any_text", "excludes": [m for m in MARKERS if m not in (END, RETURN)]}
    return [
        _analysis_tag(),
        {"type": "tag", "begin": f"{CHANNEL}final{MESSAGE}", "content": final_content or text,
         "end": [END, RETURN]},
        {"type": "tag", "begin": f"{CHANNEL}commentary{MESSAGE}", "content": text, "end": END},
    ]  # fmt: skip


def _auto(spec: GrammarSpec, tools: Sequence[FunctionTool], scope: str,
          parameters_param: Callable[[int], str], fmt: HarmonyFormat,
          json_format: GrammarSpec | None = None) -> GrammarSpec:
    """Messages (analysis, final, commentary preambles) separated by ``<|start|>assistant``,
    and at most one call, in either header spelling, which ends the turn; the final message's
    content follows ``json_format`` when one is given."""
    calls = []
    for index, tool in enumerate(tools):
        content = fmt.content(tool, parameters_param(index), scope)
        for header in (template_call_header(tool.name), harmony_call_header(tool.name)):
            calls.append({"type": "tag", "begin": header, "content": content, "end": CALL})
    final = _format_of(json_format, scope) if json_format is not None else None
    one_call = {"type": "tags_with_separator", "tags": calls, "separator": NEXT_MESSAGE,
                "at_least_one": True, "stop_after_first": True}
    some_messages = {"type": "tags_with_separator", "tags": _messages(final),
                     "separator": NEXT_MESSAGE, "at_least_one": True}
    grammar = {"type": "or", "elements": [
        some_messages, one_call,
        {"type": "sequence", "elements": [some_messages, _const(NEXT_MESSAGE), one_call]}]}
    if json_format is not None and not _json_spec(json_format).forced_text_finite:
        spec = GrammarSpec(spec.kind, spec.source, param=spec.param, forced_text_finite=False)
    return _wrap(spec, grammar)


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of ``text`` that may be the start of a marker."""
    at = text.rfind("<", max(0, len(text) - max(map(len, MARKERS))))
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in MARKERS) else 0


class HarmonyParser:
    """Feed a choice's text (markers visible) as it streams; get tools/parser.py's events:
    analysis as reasoning, final and preambles as text, a call once its body is whole."""

    def __init__(self, tools: Sequence[FunctionTool] = ()) -> None:
        self.tools = tools
        self._buffer = ""
        self._state = "header"  # header | body | plain
        self._channel = ""
        self._recipient: str | None = None
        self._calls: list[ToolCallOutput] = []
        self._analysis: list[str] = []  # this output's analysis so far

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer:
            if self._state == "plain":
                events.append(TextPiece(self._buffer))
                self._buffer = ""
            elif self._state == "header":
                if not self._read_header():
                    break
            elif not self._read_body(events):
                break
        return events

    def finish(self) -> list[Event]:
        """Flush at the end of the output: a call's body ends there (its ``<|call|>`` is the
        stop token, which the engine does not show); a cut message is what it is so far."""
        events: list[Event] = []
        if self._state == "plain" and self._buffer:
            events.append(TextPiece(self._buffer))
        elif self._state == "body":
            self._close_body(events, self._buffer, complete=True)
        self._buffer, self._state = "", "header"
        return events

    def _read_header(self) -> bool:
        """Move the next message's header out of the buffer; False while it is incomplete."""
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if len(self._buffer) > MAX_HEADER_CHARS or not _may_be_header(self._buffer):
                self._state = "plain"  # unconstrained text that is no harmony at all
                return True
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient else None
        if self._recipient is not None and not self._recipient.startswith("functions."):
            # a built-in tool (browser.*, python): never declared by the gateway, so never a
            # call a client could run; its message is shown as text (docs/tool-formats.md)
            self._recipient = None
        self._state = "body"
        return True

    def _read_body(self, events: list[Event]) -> bool:
        ends = [(at, m) for m in _BODY_ENDS if (at := self._buffer.find(m)) >= 0]
        if not ends:
            if self._recipient is None:  # stream the text, holding back a partial marker
                keep = _partial_marker(self._buffer)
                self._emit(events, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = min(ends)
        body = self._buffer[:at]
        self._buffer = self._buffer[at + (0 if marker == START else len(marker)):]
        self._close_body(events, body, complete=True)
        self._state = "header"
        return True

    def _emit(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if self._channel == "analysis":
            self._analysis.append(text)
            events.append(ReasoningPiece(text))
        else:
            events.append(TextPiece(text))

    def _close_body(self, events: list[Event], body: str, *, complete: bool) -> None:
        if self._recipient is None:
            self._emit(events, body)
            return
        name = self._recipient.removeprefix("functions.")
        call = ToolCallOutput(len(self._calls), new_call_id(), name, body.strip(),
                              complete=complete and _is_object(body))
        self._calls.append(call)
        if self._analysis and call.complete:
            ANALYSES.put(call.id, "".join(self._analysis))
        events += [CallStart(call.index, call.id, call.name),
                   CallArguments(call.index, call.arguments), CallEnd(call)]  # fmt: skip
        self._recipient = None


def _may_be_header(text: str) -> bool:
    """Whether ``text`` is (the start of) a message header: ``<|start|>assistant``, then the
    channel or the recipient."""
    for prefix in (START, "assistant"):
        if prefix.startswith(text):
            return True
        text = text.removeprefix(prefix)
    return any(text.startswith(h) or h.startswith(text) for h in (CHANNEL, " to="))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


HARMONY = register_format(HarmonyFormat())
