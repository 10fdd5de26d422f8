"""``/tokenize``, ``/detokenize`` and the cache-pin request (vLLM's shapes)."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    Field,
    model_validator,
)

from prefixgate.gateway.server.fields import (
    MAX_LABEL_CHARS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    Label,
    Text,
    TextChecked,
    TokenId,
)
from prefixgate.gateway.server.openai.schemas.chat import ChatMessage, CheckedToolChoice, Tools
from prefixgate.gateway.server.openai.schemas.sampling import RequestModel


class TokenizeRequest(TextChecked, RequestModel):
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


class DetokenizeRequest(TextChecked, RequestModel):
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


