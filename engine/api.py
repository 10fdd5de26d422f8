"""The engine's public contract with the gateway: request/sampling records, streamed deltas, errors.

The gateway builds a :class:`GenerationRequest`, calls ``engine.generate(request)`` and iterates
the async stream of :class:`Delta` records. Everything here is plain data (no torch).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

_request_counter = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_request_counter)}"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding options (OpenAI names; extras top_k, min_p, repetition_penalty)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        # NOTE: NaN passes every comparison below unnoticed; an infinity poisons the softmax
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
        bad = next((f for f in floats if not math.isfinite(getattr(self, f))), None)
        if bad is not None:
            raise InvalidRequestError(f"{bad} must be a finite number", param=bad)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequestError("seed must be a 64-bit signed integer", param="seed")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1", param="max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0", param="repetition_penalty")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs must be in [0, 20]", param="top_logprobs")
        if self.n < 1:
            raise InvalidRequestError("n must be >= 1", param="n")


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match, token by token (a constrained row). Plain data: the engine
    compiles it (engine/grammar), once per distinct ``(kind, source, strict)``.

    ``source`` by kind: ``json_schema`` the schema as JSON text (property order is kept: it is
    the order the output writes them in); ``json_object`` ignored; ``regex`` a regex; ``choice``
    a JSON list of the allowed strings; ``ebnf`` a GBNF/EBNF grammar (root rule ``root``);
    ``structural_tag`` xgrammar's structural-tag JSON (tool calls: free text, then tags).
    ``param`` names the request field it came from, for the error a bad grammar gets.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = True
    param: str = field(default="response_format", compare=False)
    # structural_tag only: its builder vouches that every text the grammar can force is finite
    # (grammar/drafts.py ``jump_forward_allowed``; other kinds are judged by the engine)
    forced_text_finite: bool = field(default=False, compare=False)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.source, self.strict)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request: already-tokenised prompt plus who sent it (tenant isolates, agent labels).

    ``grammar``: constrain the output (structured outputs, tool calls); None = free text.
    """

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    agent: str | None = None
    cache_salt: str | None = None
    request_id: str = field(default_factory=new_request_id)
    grammar: GrammarSpec | None = None
    speculative: bool = True  # False: never draft tokens for it (engine speculation is opt-in)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from cached pages (no compute)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of output for choice ``index``.

    ``text`` is decoded incrementally (never splits a multi-byte character) and never contains
    a matched stop string. ``finish_reason`` is set on the choice's last delta. ``usage`` is
    set only on the very last delta of the whole request (after every choice finished).
    ``matched_stop`` is set on the choice's last delta when one of ``SamplingParams.stop``
    ended it: the string that matched (None when it ended otherwise: EOS, a stop token, the
    end of its grammar, length, an early finish).
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    usage: Usage | None = None
    matched_stop: str | None = None


class EngineError(Exception):
    """Base of errors the gateway maps to an HTTP status and the OpenAI error envelope."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(EngineError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """Prompt + max_tokens can never fit (over the context window or the whole page pool)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str = "context length",
                 param: str = "messages"):
        # ``param``: the route's prompt field (``messages``, ``prompt`` on /v1/completions)
        super().__init__(
            f"This model's maximum {what} is {limit} tokens; the request asks for "
            f"{prompt_tokens} prompt tokens + {max_tokens} max_tokens = {prompt_tokens + max_tokens}.",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


class OverloadedError(EngineError):
    """The waiting queue is full; retry after ``retry_after`` seconds (HTTP 429)."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message, code="overloaded")
        self.retry_after = retry_after


# --------------------------------------------------------------------------------------------
# The engine as the gateway sees it. engine/async_engine.py implements it; gateway/server
# and the router depend only on this protocol (and on cache.stats for the snapshot type).
# --------------------------------------------------------------------------------------------
from collections.abc import AsyncIterator, Sequence  # noqa: E402
from typing import Any, Protocol  # noqa: E402

from prefixgate.cache.stats import CacheStats  # noqa: E402


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    max_waiting: int
    prefill_tokens_computed: int  # tokens that went through the model as prompt (not cached)
    decode_tokens: int
    num_preemptions: int
    kernel_backend: str  # "triton" or "torch"
    device: str
    # compute and KV precision ("float32", "bfloat16"; docs/precision.md)
    dtype: str = "float32"
    kv_dtype: str = "float32"
    constrained_tokens: int = 0  # tokens sampled under a grammar (tool calls, JSON outputs)
    grammar_compiles: int = 0  # distinct grammars compiled (cache misses)
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_limit_failures: int = 0  # compiles refused for their time or memory limit
    grammar_cache_bytes: int = 0  # compiled grammars held by the cache now
    tier: dict[str, Any] | None = None  # the second KV tier's counters (None = no tier)
    spec_drafts: int = 0  # speculative verify chunks run
    spec_draft_tokens: int = 0  # draft tokens proposed
    spec_accepted_tokens: int = 0  # draft tokens the model agreed with (emitted)


@dataclass(frozen=True, slots=True)
class PinResult:
    num_tokens: int  # tokens of the prompt covered by pinned full blocks
    num_pages: int


class TokenizerLike(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False,
               max_tokens: int | None = None) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        max_prompt_tokens: int | None = None,
    ) -> list[int]: ...


class EngineLike(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: TokenizerLike

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream deltas; closing the iterator early (client gone) aborts the request.

        Raises (before the first delta): InvalidRequestError, ContextLengthError, OverloadedError.
        """
        ...

    def abort(self, request_id: str) -> None: ...

    def finish_early(self, request_id: str) -> None:
        """End the request now as if it stopped: finish "stop", then usage (pages released)."""
        ...

    def cache_stats(self) -> CacheStats: ...

    def engine_stats(self) -> EngineStats: ...

    async def pin(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None = None) -> PinResult: ...

    async def unpin(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None = None) -> PinResult: ...

    async def retain(self, token_ids: Sequence[int], tenant: str, cache_salt: str | None,
                     ttl_s: float) -> int:
        """Keep the prefix's cached full blocks ahead of LRU eviction for ``ttl_s`` (soft)."""
        ...

    def reset_cache(self) -> int:
        """Drop every unreferenced cached page (pinned ones stay); returns how many."""
        ...
