"""OpenAI ``/v1/completions`` request: the four prompt shapes, normalised; ``echo`` refused."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    model_validator,
)

from prefixgate.gateway.server.fields import (
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
)
from prefixgate.gateway.server.openai.schemas.sampling import SamplingRequest
from prefixgate.gateway.server.turn import ChatTurn


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


