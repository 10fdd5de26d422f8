"""OpenAI wire format: request models (validated, bounded) and response models.

Bounds live once, in the ``Annotated`` aliases below, and are shared by chat and completions.
Fields the OpenAI API defines but this server ignores (``store``, ``metadata``, ...) are
accepted and dropped, so unmodified SDKs and frameworks work; fields it cannot honour
(non-text content, ``echo``) are rejected with a 400 that names them.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from prefixgate.gateway.engine.api import GrammarSpec
from prefixgate.gateway.server.fields import (
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_LABEL_CHARS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOOLS,
    FunctionName,
    Label,
    MaxTokens,
    MinP,
    NumChoices,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    Text,
    TextChecked,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
)
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice
from prefixgate.gateway.server.tools.dialect import ToolDialect
from prefixgate.gateway.server.tools.formats.reasoning import (
    ReasoningEffort,
    TemplateKwargs,
    thinking_kwargs,
)
from prefixgate.gateway.server.tools.grammar import check_schema
from prefixgate.gateway.server.turn import ChatTurn


class _Request(BaseModel):
    # Unknown OpenAI fields are tolerated (dropped): SDKs add new ones faster than we follow.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(TextChecked, _Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    # the field an error about the prompt's length names (ContextLengthError's ``param``)
    prompt_param: ClassVar[str] = "messages"

    model: str | None = Field(default=None, max_length=MAX_LABEL_CHARS)
    n: NumChoices
    stop: Stop = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    max_tokens: MaxTokens
    temperature: Temperature
    top_p: TopP
    seed: Seed
    presence_penalty: Penalty
    frequency_penalty: Penalty
    user: Label
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extras (vLLM names).
    top_k: TopK
    min_p: MinP
    repetition_penalty: RepetitionPenalty
    cache_salt: Label
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_fields(self) -> dict[str, Any]:
        """The :class:`ChatTurn` fields chat and completions share."""
        return dict(n=self.n, stop=list(self.stop), stop_token_ids=tuple(self.stop_token_ids),
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
                    user=self.user, cache_salt=self.cache_salt)


# --------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------
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


class ToolCallFunction(_Request):
    name: str = Field(min_length=1, max_length=64)
    # OpenAI sends a JSON string; an object is accepted too (some clients send one)
    arguments: Text | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    """A call inside an earlier assistant turn (the history a client sends back)."""

    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
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




class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(max_length=64)


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
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


# --------------------------------------------------------------------------------------------
# Completions
# --------------------------------------------------------------------------------------------
def _check_prompt(value: Any) -> Any:
    """Normalise the four OpenAI prompt shapes to a list of (str | list[int])."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and len(value) > MAX_PROMPT_TOKENS:
        raise ValueError(f"a prompt list has at most {MAX_PROMPT_TOKENS} items")
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return value
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return [value]
        if all(isinstance(x, list) and x for x in value) and all(
            isinstance(t, int) and not isinstance(t, bool) for x in value for t in x
        ):
            return value
    raise ValueError(
        "prompt must be a non-empty string, a list of strings, a list of token ids, "
        "or a list of token-id lists"
    )


def _check_prompt_items(value: list[str | list[int]]) -> list[str | list[int]]:
    for item in value:
        if isinstance(item, list) and any(t < 0 for t in item):
            raise ValueError("token ids must be >= 0")
        if isinstance(item, str) and not item:
            raise ValueError("prompt strings must be non-empty")
        if isinstance(item, str) and len(item) > MAX_TEXT_CHARS:
            raise ValueError(f"a prompt string has at most {MAX_TEXT_CHARS} characters")
        if isinstance(item, list) and (len(item) > MAX_PROMPT_TOKENS or max(item) > MAX_TOKEN_ID):
            raise ValueError(f"a token-id prompt has at most {MAX_PROMPT_TOKENS} ids, each <= {MAX_TOKEN_ID}")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
    return value


Prompt = Annotated[
    list[str | list[int]], BeforeValidator(_check_prompt), AfterValidator(_check_prompt_items)
]


class CompletionRequest(SamplingRequest):
    prompt_param: ClassVar[str] = "prompt"

    prompt: Prompt
    logprobs: Annotated[int | None, Field(default=None, ge=0, le=5)]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (no server-side best-of selection)")
        return self

    def turn(self) -> ChatTurn:
        """The neutral turn: the raw prompts, no template, no tools."""
        return ChatTurn(messages=[], prompts=list(self.prompt), message_param=self.prompt_param,
                        max_tokens=self.max_tokens, logprobs=self.logprobs is not None,
                        top_logprobs=self.logprobs or 0, **self.sampling_fields())


# --------------------------------------------------------------------------------------------
# Tokenizer and cache admin
# --------------------------------------------------------------------------------------------
class TokenizeRequest(TextChecked, _Request):
    """``{"prompt": ...}`` or ``{"messages": [...], "tools": [...]}`` — exactly one of them.

    ``tools`` and ``tool_choice`` act as in a chat request, so the ids match what it would send.
    """

    model: str | None = Field(default=None, max_length=MAX_LABEL_CHARS)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: Tools
    tool_choice: CheckedToolChoice = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(TextChecked, _Request):
    model: str | None = Field(default=None, max_length=MAX_LABEL_CHARS)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


class PinRequest(TokenizeRequest):
    """What to pin: the same inputs as /tokenize, plus the tenant and salt whose pages to keep."""

    tenant: Label  # default: the caller's tenant
    cache_salt: Label
    # A pinned prefix is usually followed by other turns, not by the assistant's reply.
    add_generation_prompt: bool = False


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(BaseModel):
    content: list[LogprobEntry]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # the model's reasoning span (vLLM's field), sent only when the model reasoned
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_no_reasoning(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first carries index, id, type and name; then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends only what a delta carries: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixgate"
    # vLLM's fields, read by routers (llm-d, the Inference Extension): ``root`` the model it
    # was loaded from; ``parent`` the base model of an adapter, null for a base model
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    # compute / KV cache precision ("float32", "bfloat16"; docs/precision.md)
    dtype: str | None = None
    kv_dtype: str | None = None
    # the kernels serving it: "native-cpu", "torch-cpu", "torch-cuda" or "triton", and why
    # not the native CPU kernels where they could run (a failed build: gateway/engine/
    # kernel_report.py)
    kernel_backend: str | None = None
    kernel_fallback_reason: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
