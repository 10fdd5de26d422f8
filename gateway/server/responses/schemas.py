"""OpenAI Responses wire format: the request model and its translation to a neutral turn.

Accepted: ``input`` as a string or items (messages with ``input_text`` / ``output_text``
parts, ``function_call``, ``function_call_output``, ``reasoning`` (its text goes back with the
assistant turn after it)), ``reasoning.effort`` (reaches the chat template),
``instructions``, ``tools`` of type ``function`` and ``namespace`` (functions grouped under
a name, as Codex sends them; hosted tools such as ``web_search`` are left out of the prompt,
see :meth:`ResponsesRequest._hosted`), ``tool_choice``, ``parallel_tool_calls``,
``text.format`` (``text`` / ``json_object`` / ``json_schema``), ``max_output_tokens``,
``temperature``, ``top_p``, ``user`` / ``metadata`` (agent label), ``store``,
``previous_response_id``, ``stream``. Unknown fields are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    model_validator,
)

from prefixgate.engine.api import GrammarSpec
from prefixgate.gateway.server.content import require_part_types
from prefixgate.gateway.server.fields import (
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionName,
    Label,
    Text,
    TextChecked,
)
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice
from prefixgate.gateway.server.tools.formats.reasoning import ReasoningEffort, thinking_kwargs
from prefixgate.gateway.server.tools.grammar import check_schema
from prefixgate.gateway.server.turn import ChatTurn

MAX_INSTRUCTIONS_CHARS = 256 * 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Model):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: Text = ""
    refusal: Text | None = None


# a message's or a tool output's content: bounded as a chat message's (fields.py)
Parts = Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Parts

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return require_part_types(value, ("input_text", "output_text", "text", "refusal"), "part")

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or p.refusal or "" for p in self.content)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: FunctionName
    arguments: Text = "{}"
    id: str | None = None
    namespace: FunctionName | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text | Parts

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(
            p.text for p in self.output)


class ReasoningText(_Model):
    text: Text = ""


class ReasoningItem(_Model):
    """An earlier turn's reasoning: its text goes back to the template with the turn after it
    (templates that keep reasoning re-render it, so the prompt extends the earlier one)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = Field(default=None, max_length=MAX_CONTENT_PARTS)

    @property
    def text(self) -> str:
        return "\n".join(part.text for part in self.content or ())


class ReasoningConfig(_Model):
    effort: ReasoningEffort | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type") or "message"  # EasyInputMessage: {"role", "content"}
    return getattr(value, "type", "message")


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionToolModel(_Model):
    type: Literal["function"]
    name: FunctionName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceToolModel(_Model):
    """Functions grouped under a name (Codex's ``multi_agent_v1``): the model sees each as
    ``NAMESPACE.NAME``; its calls go back as ``name`` + ``namespace``, as OpenAI sends them."""

    type: Literal["namespace"]
    name: FunctionName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    tools: list[FunctionToolModel] = Field(min_length=1, max_length=MAX_TOOLS)

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        # a namespace may hold custom (free-form) tools too: like hosted tools, left out
        if isinstance(value, dict) and isinstance(value.get("tools"), list):
            value = {**value, "tools": [t for t in value["tools"]
                                        if not isinstance(t, dict) or t.get("type") == "function"]}
        return value


ToolModel = Annotated[FunctionToolModel | NamespaceToolModel, Field(discriminator="type")]
CALLABLE_TOOL_TYPES = ("function", "namespace")


def qualified_name(name: str, namespace: str | None) -> str:
    return f"{namespace}.{name}" if namespace else name


class NamedFunctionChoice(_Model):
    type: Literal["function"]
    name: str
    namespace: str | None = None

    @property
    def qualified(self) -> str:
        return qualified_name(self.name, self.namespace)


class TextFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


def function_models(tools: list[Any] | None) -> list[tuple[str, FunctionToolModel]]:
    """Every function a request declares with its qualified name (namespaces flattened)."""
    out: list[tuple[str, FunctionToolModel]] = []
    for tool in tools or ():
        if isinstance(tool, NamespaceToolModel):
            out += [(qualified_name(f.name, tool.name), f) for f in tool.tools]
        else:
            out.append((tool.name, tool))
    return out


def _check_tool_choice(choice: Any, info: ValidationInfo) -> Any:
    # a field validator, so the 400 names tool_choice (tools is declared first: in info.data)
    names = [name for name, _ in function_models(info.data.get("tools"))]
    if isinstance(choice, NamedFunctionChoice) and choice.qualified not in names:
        raise ValueError(f"it names {choice.qualified!r}, which is not in tools")
    if choice == "required" and not names:
        raise ValueError("'required' needs tools")
    return choice


class ResponsesRequest(TextChecked, _Model):
    model: str | None = None
    input: Text | list[InputItem]  # the string: one user message, bounded as one
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    tools: list[ToolModel] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedFunctionChoice | None,
                           AfterValidator(_check_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: Label = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    stream: bool = False
    cache_salt: Label = None  # the vLLM extra, as on the chat route
    # how long a response ending in function calls keeps its pages (gateway/server/retention.py)
    retention_seconds: float | None = Field(default=None, ge=0, le=3600)
    reasoning: ReasoningConfig | None = None  # its effort reaches the chat template

    # the types of the hosted tools (web_search, file_search, ...) left out of the prompt
    _hosted_tools: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, value: Any) -> Any:
        # easy input messages carry no "type": name it so the discriminator can pick
        if isinstance(value, dict) and isinstance(value.get("input"), list):
            value = {**value, "input": [
                {**item, "type": _item_type(item)} if isinstance(item, dict) else item
                for item in value["input"]]}
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _hosted(cls, value: Any, handler: Any) -> Any:
        # Hosted tools (web_search, file_search, code_interpreter, ...) run on OpenAI's side;
        # this gateway cannot run them, so they are left out of the prompt (logged, counted,
        # and named in the X-Prefixgate-Dropped-Tools header), never a 400.
        hosted: list[str] = []
        tools = value.get("tools") if isinstance(value, dict) else None
        if isinstance(tools, list) and len(tools) <= MAX_TOOLS:
            kept = [t for t in tools if not isinstance(t, dict)
                    or t.get("type") in CALLABLE_TOOL_TYPES]
            hosted = [re.sub(r"[^A-Za-z0-9_.-]", "?", str(t.get("type")))[:64]
                      for t in tools if t not in kept]
            value = {**value, "tools": kept}
        request = handler(value)
        request._hosted_tools = hosted
        return request

    @property
    def hosted_tools(self) -> list[str]:
        return list(self._hosted_tools)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        functions = function_models(self.tools)
        if len(functions) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} functions (namespaces included)")
        names = [name for name, _ in functions]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if isinstance(self.input, list) and len(self.input) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} input items")
        return self

    @property
    def agent_label(self) -> str | None:
        return self.user or (self.metadata or {}).get("agent") or None

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's own input as chat-template dicts (no instructions, no history)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        reasoning: str | None = None  # a reasoning item belongs to the assistant turn after it
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text or None
                continue
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text})
                if role == "assistant" and reasoning:
                    out[-1]["reasoning_content"] = reasoning
            elif isinstance(item, FunctionCallItem):
                name = qualified_name(item.name, item.namespace)
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    # consecutive calls (and the text before them) are one assistant turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                    if reasoning:
                        out[-1]["reasoning_content"] = reasoning
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            reasoning = None
        return out

    def response_format(self) -> GrammarSpec | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GrammarSpec("json_object", param="text.format")
        param = "text.format.schema"
        schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
        return GrammarSpec("json_schema", check_schema(schema, param, object_only=False),
                           strict=bool(fmt.strict), param=param)

    def parameters_param(self, index: int) -> str:
        """The request field of the schema of function ``index`` (namespaces flattened)."""
        for i, tool in enumerate(self.tools or ()):
            if not isinstance(tool, NamespaceToolModel):
                if index == 0:
                    return f"tools[{i}].parameters"
                index -= 1
            elif index < len(tool.tools):
                return f"tools[{i}].tools[{index}].parameters"
            else:
                index -= len(tool.tools)
        return "tools"

    def wire_call(self, name: str) -> dict[str, str]:
        """A call's ``name`` (and ``namespace``) as the client declared it."""
        for tool in self.tools or ():
            if isinstance(tool, NamespaceToolModel) and name.startswith(tool.name + "."):
                inner = name[len(tool.name) + 1:]
                if any(f.name == inner for f in tool.tools):
                    return {"name": inner, "namespace": tool.name}
        return {"name": name}

    def tool_choice_record(self) -> ToolChoice:
        parallel = self.parallel_tool_calls is not False
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return ToolChoice("function", self.tool_choice.qualified, parallel)
        return ToolChoice(self.tool_choice or "auto", None, parallel)

    def turn(self, history: list[dict[str, Any]]) -> ChatTurn:
        """The neutral turn: instructions, then the stored conversation, then this input."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return ChatTurn(
            messages=[*messages, *history, *self.input_messages()],
            tools=[FunctionTool(name, t.description, t.parameters, strict=t.strict is not False)
                   for name, t in function_models(self.tools)],
            tool_choice=self.tool_choice_record(),
            response_format=self.response_format(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            user=self.agent_label,
            cache_salt=self.cache_salt,
            message_param="input",
            parameters_param=self.parameters_param,
            retention_s=self.retention_seconds,
            template_kwargs=thinking_kwargs(
                None, self.reasoning.effort if self.reasoning else None),
        )


def output_messages(text: str, calls: list[dict[str, Any]], reasoning: str = ""
                    ) -> list[dict[str, Any]]:
    """A response's output as chat-template dicts, to continue the conversation from."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
