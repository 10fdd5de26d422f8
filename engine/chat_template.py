"""Render a conversation with the model's own Jinja chat template (sandboxed).

The template comes from the model file (GGUF ``tokenizer.chat_template`` or the HF
``tokenizer_config.json`` / ``chat_template.jinja``). It is untrusted code, so it runs in
jinja2's immutable sandbox with the same helpers and whitespace settings Hugging Face uses
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now`` and the ``{% generation %}`` block), so the rendered text is
byte-identical to ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

import copy
import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from prefixgate.engine.template_sandbox import (
    MAX_VALUE_CHARS,
    BoundedSandbox,
    OutputTooLongError,
    TemplateLimitError,
    render_bounded,
)


class ChatTemplateError(ValueError):
    """The model has no chat template, the template is broken, or it rejected the messages."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it
    renders its body unchanged (some templates use it, and parsing must not fail)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & for HTML; chat prompts must keep them verbatim
    if indent is not None and not 0 <= indent <= 16:
        raise jinja2.exceptions.TemplateError(f"tojson indent must be in [0, 16], got {indent}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to.

    Args:
        source: the Jinja template text.
        bos_token / eos_token: exposed to the template as ``bos_token`` / ``eos_token``.
        extra_tokens: further names the template may read (``unk_token``, ``pad_token``...).
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_tokens: dict[str, str] | None = None,
    ) -> None:
        if not source or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        self.source = source
        self._tokens: dict[str, str] = {
            name: value
            for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
            if value is not None
        }
        self._tokens.update(extra_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the model's chat template does not parse (line {exc.lineno}): {exc.message}"
            ) from exc

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes a ``tools`` list into the prompt (probed once)."""
        probe = {"type": "function", "function": {
            "name": "prefixgate_probe_tool", "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.render([{"role": "user", "content": "hi"}], tools=[probe])
        except (ChatTemplateError, OutputTooLongError):  # a probe is tiny: such a template is
            return False  # broken, and every request will say so
        return "prefixgate_probe_tool" in text

    @functools.cached_property
    def takes_system(self) -> bool:
        """Whether the template accepts a system turn (Gemma 2's raises on one; probed once)."""
        try:
            self.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except (ChatTemplateError, OutputTooLongError):
            return False
        return True

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        max_output_chars: int = MAX_VALUE_CHARS,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts: role, content, tool_calls...) to prompt text.

        Args:
            messages: the conversation; roles system/user/assistant/tool are passed as given.
            tools: JSON-schema tool definitions, handed to the template unchanged.
            add_generation_prompt: append the header that opens the assistant's turn.
            max_output_chars: stop (OutputTooLongError) once the text is longer than this.
            template_kwargs: extra variables some templates read (e.g. ``enable_thinking``).

        Returns:
            The prompt text, special tokens spelled out (tokenise it without adding more).

        Raises:
            ChatTemplateError: bad messages, or the template raised (``raise_exception``),
                failed, or went over a bound of engine/template_sandbox.py.
            OutputTooLongError: the text passed ``max_output_chars``.
        """
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list of dicts")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ChatTemplateError(f"messages[{index}] must be a dict with a 'role'")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ChatTemplateError("tools must be a list of JSON-schema dicts")
        variables = {
            **self._tokens,
            **template_kwargs,
            # deep copies: a template may not mutate the caller's records (the sandbox is
            # immutable anyway, this also detaches tuples/records the caller keeps using)
            "messages": copy.deepcopy(messages),
            "tools": copy.deepcopy(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return render_bounded(self._template, variables, max_output_chars)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        except OutputTooLongError:
            raise
        except TemplateLimitError as exc:
            raise ChatTemplateError(f"the chat template went over a limit: {exc}") from exc
        except (ArithmeticError, LookupError, AttributeError, TypeError, ValueError,
                RecursionError) as exc:
            # the template is code from the model file: its failure fails this request alone
            raise ChatTemplateError(
                f"the chat template failed ({type(exc).__name__}: {exc})") from exc
