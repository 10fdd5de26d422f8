"""The served model's tool dialect: its tool-call format and reasoning span, chosen once from
its chat template, and the one place the API surfaces get prompt inputs, grammars and output
parsers from (so every surface speaks the model's own format the same way).

* **format**: the one its template teaches (tools/formats; ``--tool-call-format`` overrides).
  A template that teaches none, or that does not render the tool list itself, gets the
  gateway's Hermes format (tools/prompt.py), as the default SmolLM2 does.
* **native**: the template renders the tools and the history (calls, results) itself, in that
  format; otherwise the gateway writes them into the messages (tools/prompt.py).
* **reasoning**: the template's ``<think>`` span, split from the answer (formats/reasoning.py).
  Where the template opens the span in the generation prompt (Qwen3.5 thinks unless asked
  not to), an output the grammar constrains from its first token (a forced call, a JSON
  answer) closes the empty span first, as the template re-renders it; and the reasoning the
  gateway wrote before a call goes back into a call turn a client sent without it (templates
  that render a running chain's reasoning: Qwen3, Qwen3.5), so the turn re-renders as written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.engine.api import GrammarSpec
from prefixgate.gateway.server.tools.formats import ToolCallFormat, format_for_template
from prefixgate.gateway.server.tools.formats.base import FormatStreamParser
from prefixgate.gateway.server.tools.formats.harmony import AnalysisStore
from prefixgate.gateway.server.tools.formats.hermes import HERMES
from prefixgate.gateway.server.tools.formats.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    reasoning_for_template,
    starts_inside,
)
from prefixgate.gateway.server.tools.grammar import _format_of
from prefixgate.gateway.server.tools.parser import ToolCallParser
from prefixgate.gateway.server.tools.prompt import native_messages, prepare_messages, tool_json
from prefixgate.gateway.server.tools.records import FunctionTool, ToolChoice
from prefixgate.gateway.server.tools.repeats import GuardedParser, _PlainText

AUTO = "auto"
# the reasoning each call was written after, by call id (any format with a reasoning span;
# harmony keeps its analysis itself): see ``ToolDialect.template_inputs``
REASONING_KEPT = AnalysisStore()


@dataclass(frozen=True, slots=True)
class ToolDialect:
    format: ToolCallFormat = HERMES
    native: bool = False
    reasoning: ReasoningFormat | None = None
    system_turn: bool = True  # the template takes a system turn (the gateway's tools go there)

    def template_inputs(
        self, messages: list[dict[str, Any]], tools: Sequence[FunctionTool] | None,
        message_param: str = "messages",
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """``(messages, tools)`` to hand the chat template (replicas and the router render a
        conversation identically through this)."""
        if self.native:
            template_tools = (self.format.template_tools([tool_json(t) for t in tools])
                              if tools else None)
            history = native_messages(messages, message_param=message_param)
            if self.reasoning is not None:
                history = [_with_kept_reasoning(m) for m in history]
            return self.format.history_messages(history), template_tools
        return prepare_messages(messages, tools, message_param=message_param,
                                system_turn=self.system_turn), None

    def grammar(
        self, tools: Sequence[FunctionTool], choice: ToolChoice,
        response_format: GrammarSpec | None, parameters_param: Callable[[int], str],
        scope: str = "", prompt_tail: str = "",
    ) -> GrammarSpec | None:
        """The output grammar: calls in this dialect's format (tools/grammar.py).

        ``prompt_tail``: the end of the rendered prompt. When it opened the reasoning span
        (Qwen3.5 with thinking on), a grammar that constrains the output from its first token
        (a forced call, a JSON answer, the JSON-or-calls of ``auto``) first closes the span,
        empty, as the template re-renders an empty span (``<think>\n`` + ``\n</think>\n\n``):
        otherwise the call or the answer would be written inside the span, as reasoning. Under
        ``auto`` without a response format the model reasons and closes the span itself; a
        client's own grammar (regex, EBNF, choice) writes the whole output, span included.
        """
        spec = self.format.grammar(tools, choice, response_format, parameters_param, scope)
        if (spec is None or self.reasoning is None or self.format.channels
                or not starts_inside(self.reasoning, prompt_tail)):
            return spec
        return _after_empty_span(spec, f"\n{self.reasoning.end}\n\n", scope)

    def parses(self, tools: Sequence[FunctionTool] | None) -> bool:
        """Whether an output is parsed (it may hold calls or a reasoning span)."""
        return bool(tools) or self.reasoning is not None or self.format.channels

    def parser(
        self, tools: Sequence[FunctionTool] | None, on_repeat: Callable[[], None] | None,
        prompt_tail: str = "",
    ) -> GuardedParser | None:
        """A new parser for one choice's output; None when there is nothing to parse (no
        visible tools and no reasoning span: the text is the answer).

        Args:
            tools: the tools the model sees (None: calls are not parsed).
            on_repeat: what to do at a runaway repeated call (tools/repeats.py).
            prompt_tail: the end of the rendered prompt (a template may open the span there).
        """
        if not self.parses(tools):
            return None
        inner: Any = _PlainText()
        if self.format.channels:  # harmony: one parser splits channels and finds calls
            inner = self.format.stream_parser(tools)  # type: ignore[attr-defined]
        elif tools:
            # the Hermes parser streams a call's arguments as they come; the others per call
            inner = ToolCallParser() if self.format is HERMES else FormatStreamParser(
                self.format, tools)
        splitter = remember = None
        if self.reasoning is not None:
            splitter = ReasoningSplitter(
                self.reasoning, starts_inside=starts_inside(self.reasoning, prompt_tail))
            remember = REASONING_KEPT.put if self.native else None
        return GuardedParser(on_repeat, parser=inner, splitter=splitter, remember=remember)


def _with_kept_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant call turn sent back without reasoning, with the reasoning this gateway
    wrote before its first call (NOTE: keyed by the gateway's random call ids, seen only by the
    client that got the call; in-process: on another replica the turn renders as sent, a
    cache miss, never a different conversation). A turn that carries reasoning renders as
    sent; the template decides where reasoning is rendered (Qwen3.5 and Qwen3: every turn
    after the last user query), so this changes nothing where it drops it."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls or message.get("reasoning_content"):
        return message
    call_id = calls[0].get("id") if isinstance(calls[0], dict) else None
    kept = REASONING_KEPT.get(call_id) if isinstance(call_id, str) else None
    return message if kept is None else {**message, "reasoning_content": kept}


def _after_empty_span(spec: GrammarSpec, close: str, scope: str) -> GrammarSpec:
    """``spec`` with ``close`` written first, where ``spec`` constrains the first token."""
    if spec.kind == "structural_tag":
        grammar = json.loads(spec.source)["format"]
        if grammar.get("type") == "triggered_tags":
            return spec  # free text until a call: the model closes the span itself
    elif spec.kind in ("json_schema", "json_object"):
        grammar = _format_of(spec, scope)
    else:
        return spec  # the client's own grammar
    source = json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": close}, grammar]}}, ensure_ascii=False)
    return GrammarSpec("structural_tag", source, param=spec.param,
                       forced_text_finite=spec.forced_text_finite)


def choose_dialect(template: Any, override: str | None = None) -> ToolDialect:
    """The dialect of a model's chat template (a ``ChatTemplate`` or None).

    Args:
        template: the tokenizer's chat template (``source``, ``renders_tools``).
        override: a format name (``--tool-call-format``); None or ``auto`` = detect.

    Raises:
        ValueError: the override names a format the template does not render tools in (the
            gateway itself writes tool prompts in Hermes only).
    """
    source = getattr(template, "source", None)
    override = None if override in (None, "", AUTO) else override
    fmt = format_for_template(source, override) or HERMES
    renders_tools = bool(source and getattr(template, "renders_tools", False))
    # native: the template writes tools in the format we enforce; one that renders tools in
    # another format (or one we do not know) gets the gateway's Hermes prompt instead
    native = renders_tools and fmt.detect(source or "")
    if native:
        fmt = fmt.for_template(source or "")
    if not native and override is None:
        # e.g. DeepSeek R1's template writes calls in the history but never the tool list:
        # the gateway's Hermes prompt tells the model both
        fmt = HERMES
    elif not native and fmt is not HERMES:
        raise ValueError(
            f"tool-call format {fmt.name!r}: the model's chat template does not render tools "
            "in it, and the gateway writes tool prompts only in the 'hermes' format")
    system_turn = bool(getattr(template, "takes_system", True))
    return ToolDialect(fmt, native, reasoning_for_template(source), system_turn)
