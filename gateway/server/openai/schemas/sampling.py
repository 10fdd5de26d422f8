"""OpenAI request fields every completion-style request shares: the tolerant base model, stream
options, the sampling fields of chat and completions (bounds in gateway/server/fields.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from prefixgate.gateway.server.fields import (
    MAX_LABEL_CHARS,
    MAX_STOP_TOKEN_IDS,
    Label,
    MaxTokens,
    MinP,
    NumChoices,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TextChecked,
    TokenId,
    TopK,
    TopP,
)


class RequestModel(BaseModel):
    # Unknown OpenAI fields are tolerated (dropped): SDKs add new ones faster than we follow.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(TextChecked, RequestModel):
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


