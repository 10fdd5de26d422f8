"""OpenAI ``/v1/chat/completions`` request: messages, tools and tool choice, response formats.

Fields the OpenAI API defines but this server ignores (``store``, ``metadata``, ...) are
accepted and dropped; fields it cannot honour (non-text content) are rejected with a 400 that
names them."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from prefixgate.engine.api import GrammarSpec
from prefixgate.gateway.server.fields import (
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_LABEL_CHARS,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    MAX_TOOLS,
    FunctionName,
    MaxTokens,
    Text,
    TopLogprobs,
)
from prefixgate.gateway.server.openai.schemas.sampling import RequestModel, SamplingRequest
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice
from prefixgate.gateway.server.tools.dialect import ToolDialect
from prefixgate.gateway.server.tools.formats.reasoning import (
    ReasoningEffort,
    TemplateKwargs,
    thinking_kwargs,
)
from prefixgate.gateway.server.tools.grammar import check_schema
from prefixgate.gateway.server.turn import ChatTurn


def _flatten_content(value: Any) -> Any:
    """``"text"`` or ``[{"type": "text", "text": ...}, ...]`` → one string (parts joined by \\n)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of text parts")
    if len(value) > MAX_CONTENT_PARTS:
        raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts, got {len(value)}")
    texts = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ValueError(
                f"content part {i} must be an object like {{'type': 'text', 'text': ...}}"
            )
        kind = part.get("type")
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise ValueError(
                f"content part {i} has type {kind!r}; this text-only model accepts only 'text' parts"
            )
        texts.append(part["text"])
    return "\n".join(texts)


# the bound sits on the str branch: an assistant turn with tool_calls has content None
Content = Annotated[Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None,
                    BeforeValidator(_flatten_content)]


class ToolCallFunction(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    # OpenAI sends a JSON string; an object is accepted too (some clients send one)
    arguments: Text | dict[str, Any] = "{}"


class ToolCallIn(RequestModel):
    """A call inside an earlier assistant turn (the history a client sends back)."""

    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = Field(default=None, max_length=MAX_LABEL_CHARS)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=MAX_LABEL_CHARS)  # tool turns answering a call
    # an earlier assistant turn's reasoning (vLLM's field): templates that keep it re-render it
    reasoning_content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it (``developer`` is a system turn for HF templates)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content if self.content is not None else "",
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        return out




class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(max_length=64)


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """``text``, ``json_object``, ``json_schema`` (OpenAI); extras ``regex`` (``regex``),
    ``choice`` (``choice``: the allowed strings) and ``grammar`` (EBNF, root rule ``root``)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"] = "text"
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, min_length=1, max_length=256)
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _fields_of_type(self) -> ResponseFormat:
        needed = {"json_schema": self.json_schema, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar}
        if self.type in needed and needed[self.type] is None:
            raise ValueError(f"response_format type {self.type!r} needs the field {self.type!r}")
        return self

    def grammar_spec(self, param: str = "response_format") -> GrammarSpec | None:
        """The engine grammar of this format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object", param=param)
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {
                "type": "object"}
            text = check_schema(schema, f"{param}.json_schema.schema", object_only=False)
            return GrammarSpec("json_schema", text, strict=bool(self.json_schema.strict),
                               param=f"{param}.json_schema.schema")
        if self.type == "regex":
            return GrammarSpec("regex", self.regex or "", param=f"{param}.regex")
        if self.type == "choice":
            return GrammarSpec("choice", json.dumps(self.choice, ensure_ascii=False),
                               param=f"{param}.choice")
        return GrammarSpec("ebnf", self.grammar or "", param=f"{param}.grammar")


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice | None


def function_tools(tools: list[ToolDefinition] | None) -> list[FunctionTool]:
    return [
        FunctionTool(t.function.name, t.function.description, t.function.parameters,
                     strict=t.function.strict is not False)
        for t in tools or ()
    ]


def tool_choice_of(choice: ToolChoiceField, parallel: bool | None) -> ToolChoice:
    parallel = parallel is not False
    if isinstance(choice, NamedToolChoice):
        return ToolChoice("function", choice.function.name, parallel)
    return ToolChoice(choice or "auto", None, parallel)


def _unique_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [t.function.name for t in tools or ()]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"tool names must be unique; {duplicate!r} appears twice")
    return tools


def _check_tool_choice(choice: ToolChoiceField, info: ValidationInfo) -> ToolChoiceField:
    """A required or named choice needs tools, and a named one must be among them.

    NOTE: a field validator (not a model one), so the 400 names ``tool_choice``; it runs after
    ``tools`` (declared first), whose validated value is in ``info.data``.
    """
    names = [t.function.name for t in info.data.get("tools") or ()]
    if choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"it names {choice.function.name!r}, which is not in tools")
    return choice


Tools = Annotated[list[ToolDefinition] | None, Field(default=None, max_length=MAX_TOOLS),
                  AfterValidator(_unique_tools)]
CheckedToolChoice = Annotated[ToolChoiceField, AfterValidator(_check_tool_choice)]


def template_tools(
    tools: list[ToolDefinition] | None, tool_choice: ToolChoiceField
) -> list[FunctionTool] | None:
    """The tools the model sees; ``tool_choice="none"`` hides them."""
    if not tools or tool_choice == "none":
        return None
    return function_tools(tools)


class ChatCompletionRequest(SamplingRequest):
    prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Tools
    tool_choice: CheckedToolChoice = None
    parallel_tool_calls: bool | None = None
    # how long a response ending in tool calls keeps its pages (gateway/server/retention.py)
    retention_seconds: float | None = Field(default=None, ge=0, le=3600)
    max_completion_tokens: MaxTokens
    logprobs: bool = False
    top_logprobs: TopLogprobs
    response_format: ResponseFormat | None = None
    # reasoning controls, handed to the chat template (tools/formats/reasoning.py)
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[FunctionTool] | None:
        return template_tools(self.tools, self.tool_choice)

    def output_grammar(self, scope: str = "", dialect: ToolDialect | None = None
                       ) -> GrammarSpec | None:
        """The grammar of the whole output: tool calls and/or the response format.

        ``scope``: the tenant (grammar caches are per tenant, gateway/server/tools/grammar.py);
        ``dialect``: the served model's (calls in its format; None = the gateway's Hermes).
        """
        response = self.response_format.grammar_spec() if self.response_format else None
        return (dialect or ToolDialect()).grammar(
            function_tools(self.tools), tool_choice_of(self.tool_choice, self.parallel_tool_calls),
            response, lambda i: f"tools[{i}].function.parameters", scope=scope)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template reads besides the messages: ``chat_template_kwargs``, with
        ``reasoning_effort`` mapped onto ``enable_thinking`` unless those name it."""
        return {**thinking_kwargs(None, self.reasoning_effort),
                **(self.chat_template_kwargs.model_dump(exclude_none=True)
                   if self.chat_template_kwargs else {})}

    def turn(self) -> ChatTurn:
        """The neutral turn (gateway/server/turn.py) this request asks for."""
        return ChatTurn(
            messages=self.template_messages(),
            tools=function_tools(self.tools),
            tool_choice=tool_choice_of(self.tool_choice, self.parallel_tool_calls),
            response_format=self.response_format.grammar_spec() if self.response_format else None,
            max_tokens=self.requested_max_tokens,
            parameters_param=lambda i: f"tools[{i}].function.parameters",
            retention_s=self.retention_seconds,
            template_kwargs=self.template_kwargs(),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            **self.sampling_fields(),
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


