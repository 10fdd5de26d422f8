"""Anthropic Messages wire format: request models (validated, bounded) and the translation to
a neutral :class:`ChatTurn`; response and stream-event shapes are plain dicts in writer.py.

Accepted: ``system`` (a string or text blocks), ``messages`` with ``text``, ``tool_use`` and
``tool_result`` blocks, ``tools`` (``input_schema``), ``tool_choice`` auto / any / tool / none
(``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens`` (required),
``temperature`` / ``top_p`` / ``top_k``, ``metadata.user_id`` (the agent label for stats),
``output_config.format`` (a JSON schema the reply follows), ``cache_control`` on the request
and on system, tool and message blocks (accepted; see the README), ``system`` messages inside
``messages`` (Claude Code's mid-conversation-system beta). ``max_tokens`` past the context
left is cut to fit. Claude Code's attribution line (``x-anthropic-billing-header: ...``) is
left out of the prompt (gateway/server/clients.py). ``thinking``
(enabled / disabled) reaches the chat template (``enable_thinking``), and ``thinking`` blocks
of earlier assistant turns go back as their reasoning. Unknown fields (``context_management``,
``output_config.effort``) are ignored; blocks this text-only model
cannot take (images, documents) are a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from prefixgate.engine.api import GrammarSpec
from prefixgate.gateway.server.clients import is_attribution, strip_attribution
from prefixgate.gateway.server.content import require_part_types
from prefixgate.gateway.server.fields import (
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    FunctionName,
    Label,
    Text,
    TextChecked,
)
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice
from prefixgate.gateway.server.tools.formats.reasoning import thinking_kwargs
from prefixgate.gateway.server.tools.grammar import check_schema
from prefixgate.gateway.server.turn import ChatTurn


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(_Model):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None


class _Cacheable(_Model):
    """A part of a request that may carry a ``cache_control`` breakpoint (text, tool_use and
    tool_result blocks, system blocks, tools). Thinking blocks may not (Anthropic's rule), so
    they do not derive from it: read breakpoints through :func:`cache_controls`, never by
    assuming every block has the field."""

    cache_control: CacheControl | None = None


class TextBlock(_Cacheable):
    type: Literal["text"]
    text: Text  # bounded as a chat message's content (fields.py)


TextBlocks = Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)]


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: FunctionName
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Cacheable):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Text | TextBlocks = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(
            b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Model):
    """An earlier turn's reasoning; ``redacted_thinking`` blocks (opaque data) are dropped."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: Text = ""
    signature: str | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(_Model):
    # "system": Claude Code's mid-conversation system messages (the mid-conversation-system
    # beta): text only, rendered as a system turn where they stand
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("role") == "system":
            return require_part_types(value, ("text",), "block")
        return require_part_types(
            value, ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"), "block")


class Tool(_Cacheable):
    name: FunctionName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoiceModel(_Model):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Model):
    user_id: Label = None


class OutputFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    """Structured outputs: the reply's text is JSON matching ``format.schema``."""

    format: OutputFormat | None = None


class CountTokensRequest(TextChecked, _Model):
    """The conversation part of a request (all that /v1/messages/count_tokens takes)."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | TextBlocks | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceModel | None = None
    cache_control: CacheControl | None = None  # automatic caching: prefixes are cached anyway
    _attribution_removed: int = PrivateAttr(0)

    @model_validator(mode="after")
    def _check(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice type 'tool' needs a name")
            if choice.name not in names:
                raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        if choice is not None and choice.type == "any" and not names:
            raise ValueError("tool_choice type 'any' needs tools")
        return self

    def system_text(self, blocks: str | list[TextBlock] | None) -> str:
        """System text without Claude Code's attribution line (clients.py); counts removals."""
        if blocks is None:
            return ""
        if isinstance(blocks, str):
            text, removed = strip_attribution(blocks)
            self._attribution_removed += removed
            return text
        kept = [b.text for b in blocks if not is_attribution(b.text)]
        self._attribution_removed += len(blocks) - len(kept)
        return "\n".join(kept)

    @property
    def attribution_removed(self) -> int:
        """Attribution blocks left out by the last :meth:`chat_messages`."""
        return self._attribution_removed

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template dicts (tool_use → tool_calls, tool_result → tool)."""
        out: list[dict[str, Any]] = []
        self._attribution_removed = 0
        system = self.system_text(self.system)
        if system:
            out.append({"role": "system", "content": system})
        for message in self.messages:
            if message.role == "system":
                text = self.system_text(message.content)  # type: ignore[arg-type]
                if text:
                    out.append({"role": "system", "content": text})
                continue
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            texts = [b.text for b in message.content if isinstance(b, TextBlock)]
            if message.role == "assistant":
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in message.content if isinstance(b, ToolUseBlock)]
                turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
                if calls:
                    turn["tool_calls"] = calls
                thinking = [b.thinking for b in message.content
                            if isinstance(b, ThinkingBlock) and b.type == "thinking"]
                if thinking:
                    turn["reasoning_content"] = "\n".join(thinking)
                out.append(turn)
                continue
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text})
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
        return out

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool(t.name, t.description, t.input_schema) for t in self.tools or ()]

    def tool_choice_record(self) -> ToolChoice:
        choice = self.tool_choice or ToolChoiceModel()
        mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[choice.type]
        return ToolChoice(mode, choice.name, not choice.disable_parallel_tool_use)

    def turn(self) -> ChatTurn:
        return ChatTurn(messages=self.chat_messages(), tools=self.function_tools(),
                        tool_choice=self.tool_choice_record())


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    stream: bool = False

    def response_format(self) -> GrammarSpec | None:
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return None
        param = "output_config.format.schema"
        return GrammarSpec("json_schema", check_schema(fmt.schema_, param, object_only=False),
                           param=param)

    def turn(self) -> ChatTurn:
        return ChatTurn(
            messages=self.chat_messages(),
            tools=self.function_tools(),
            tool_choice=self.tool_choice_record(),
            response_format=self.response_format(),
            max_tokens=self.max_tokens,
            clamp_max_tokens=True,  # a cap, not a demand: Claude Code sends 32k-64k
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=list(self.stop_sequences),
            report_stop=True,  # Anthropic's stop_sequence names the one that matched
            user=self.metadata.user_id if self.metadata else None,
            parameters_param=lambda i: f"tools[{i}].input_schema",
            retention_s=self.cache_ttl_s(),
            hold_s=self.cache_ttl_s(),
            template_kwargs=thinking_kwargs(
                None if self.thinking is None else self.thinking.type != "disabled"),
        )

    def cache_ttl_s(self) -> float | None:
        """The longest ``cache_control`` TTL on the request or any block (5m by default)."""
        parts: list[Any] = [*(self.system if isinstance(self.system, list) else ()),
                            *(self.tools or ())]
        for message in self.messages:
            if not isinstance(message.content, str):
                parts += message.content
        controls = cache_controls(parts)
        if self.cache_control:
            controls.append(self.cache_control)
        if not controls:
            return None
        return max(3600.0 if c.ttl == "1h" else 300.0 for c in controls)


def cache_controls(parts: list[Any]) -> list[CacheControl]:
    """The ``cache_control`` breakpoints set on ``parts`` and on the text blocks inside their
    tool results; parts that cannot carry one (thinking blocks) are skipped."""
    found: list[CacheControl] = []
    for part in parts:
        if isinstance(part, ToolResultBlock) and not isinstance(part.content, str):
            found += cache_controls(list(part.content))
        if isinstance(part, _Cacheable) and part.cache_control is not None:
            found.append(part.cache_control)
    return found
