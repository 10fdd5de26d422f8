"""OpenAI wire format: request models (validated, bounded) and response models.

Bounds live once, in the ``Annotated`` aliases below, and are shared by chat and completions.
Fields the OpenAI API defines but this server ignores (``store``, ``metadata``, ...) are
accepted and dropped, so unmodified SDKs and frameworks work; fields it cannot honour
(non-text content, ``echo``, JSON mode) are rejected with a 400 that names them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# --------------------------------------------------------------------------------------------
# Shared field definitions (the bounds of every sampling knob, in one place)
# --------------------------------------------------------------------------------------------
MAX_N = 16  # choices per request: each one holds its own pages
MAX_STOP_STRINGS = 16
MAX_LABEL_CHARS = 256  # `user` / X-Agent-Id / cache_salt: they key stats and hashes

MaxTokens = Annotated[int | None, Field(default=None, ge=1)]
Temperature = Annotated[float | None, Field(default=None, ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(default=None, gt=0.0, le=1.0)]
TopK = Annotated[int | None, Field(default=None, ge=-1)]  # -1 or 0 = off (vLLM and HF spellings)
MinP = Annotated[float | None, Field(default=None, ge=0.0, le=1.0)]
Penalty = Annotated[float | None, Field(default=None, ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float | None, Field(default=None, gt=0.0, le=10.0)]
Seed = Annotated[int | None, Field(default=None, ge=-(2**63), le=2**64 - 1)]
NumChoices = Annotated[int, Field(default=1, ge=1, le=MAX_N)]
TopLogprobs = Annotated[int | None, Field(default=None, ge=0, le=20)]
Label = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_LABEL_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


def _stop_list(value: Any) -> Any:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


def _check_stop(value: list[str]) -> list[str]:
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    if any(not s for s in value):
        raise ValueError("stop strings must be non-empty")
    return value


Stop = Annotated[list[str], BeforeValidator(_stop_list), AfterValidator(_check_stop)]


class _Request(BaseModel):
    # Unknown OpenAI fields are tolerated (dropped): SDKs add new ones faster than we follow.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    n: NumChoices
    stop: Stop = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
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


# --------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------
def _flatten_content(value: Any) -> Any:
    """``"text"`` or ``[{"type": "text", "text": ...}, ...]`` → one string (parts joined by \\n)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of text parts")
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


Content = Annotated[str | None, BeforeValidator(_flatten_content)]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns answering a call

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
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(_Request):
    type: str = "text"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


def template_tools(
    tools: list[ToolDefinition] | None, tool_choice: ToolChoice
) -> list[dict[str, Any]] | None:
    """Tools handed to the chat template; ``tool_choice="none"`` hides them from the model."""
    if not tools or tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = None
    max_completion_tokens: MaxTokens
    logprobs: bool = False
    top_logprobs: TopLogprobs
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                f"response_format type {self.response_format.type!r} is not supported (only 'text')"
            )
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, not in tools"
                )
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools, self.tool_choice)

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
    if len(value) > 64:
        raise ValueError(f"at most 64 prompts per request, got {len(value)}")
    return value


Prompt = Annotated[
    list[str | list[int]], BeforeValidator(_check_prompt), AfterValidator(_check_prompt_items)
]


class CompletionRequest(SamplingRequest):
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


# --------------------------------------------------------------------------------------------
# Tokenizer and cache admin
# --------------------------------------------------------------------------------------------
class TokenizeRequest(_Request):
    """``{"prompt": ...}`` or ``{"messages": [...], "tools": [...]}`` — exactly one of them.

    ``tools`` and ``tool_choice`` act as in a chat request, so the ids match what it would send.
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = None
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


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class PinRequest(TokenizeRequest):
    """What to pin: the same inputs as /tokenize, plus the tenant and salt whose pages to keep."""

    tenant: str | None = None  # default: the caller's tenant
    cache_salt: Label
    # A pinned prefix is usually followed by other turns, not by the assistant's reply.
    add_generation_prompt: bool = False


class PinResponse(BaseModel):
    pinned: bool
    num_tokens: int
    num_pages: int
    tenant: str


class ResetResponse(BaseModel):
    num_pages_dropped: int


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

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
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
