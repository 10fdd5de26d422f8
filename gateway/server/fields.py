"""Request field definitions shared by every API surface (OpenAI chat/completions, Responses,
Anthropic Messages): the bounds of every size and sampling knob, in one place."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

# --------------------------------------------------------------------------------------------
# Shared field definitions (the bounds of every sampling knob, in one place)
# --------------------------------------------------------------------------------------------
# Every numeric and size field is bounded here, so a bad value is a 400 naming its field and
# never reaches the engine; bounds that depend on the model (top_k <= vocabulary size, prompt +
# max_tokens <= context) are checked by the engine before the request is queued, also as 400s.
MAX_N = 16  # choices per request: each one holds its own pages
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # per stop string: matched against the output's tail every token
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # token ids and token counts fit int32 (the vocabulary is checked later)
MAX_TEXT_CHARS = 1 << 20  # one message's content, one prompt string, one tool call's arguments
MAX_CONTENT_PARTS = 256
MAX_PROMPT_TOKENS = 1 << 20  # one token-id prompt (the context length cuts it much shorter)
MAX_PROMPTS = 64  # /v1/completions: prompts in one request
MAX_LABEL_CHARS = 256  # `user` / X-Agent-Id / cache_salt: they key stats and hashes
MAX_MESSAGES = 2048
MAX_TOOLS = 128
# one tool's description: Claude Code 2.1's longest (Workflow) is 18,780 characters; the whole
# request stays bounded by MAX_TOOLS and the body-size limit (gateway/http/limits.py)
MAX_DESCRIPTION_CHARS = 32 * 1024
MAX_MODEL_ALIASES = 32  # --model-alias globs: each request's model is matched against them all
MAX_ALIAS_CHARS = 256
MAX_GRAMMAR_CHARS = 64 * 1024  # regex / EBNF text of a response_format

MaxTokens = Annotated[int | None, Field(default=None, ge=1, le=MAX_TOKEN_ID)]
Temperature = Annotated[float | None, Field(default=None, ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(default=None, gt=0.0, le=1.0)]
# -1 or 0 = off (vLLM and HF spellings); the engine also rejects top_k > its vocabulary size
TopK = Annotated[int | None, Field(default=None, ge=-1, le=MAX_TOKEN_ID)]
MinP = Annotated[float | None, Field(default=None, ge=0.0, le=1.0)]
Penalty = Annotated[float | None, Field(default=None, ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float | None, Field(default=None, gt=0.0, le=10.0)]
Seed = Annotated[int | None, Field(default=None, ge=-(2**63), le=2**63 - 1)]  # int64
NumChoices = Annotated[int, Field(default=1, ge=1, le=MAX_N)]
TopLogprobs = Annotated[int | None, Field(default=None, ge=0, le=20)]
Label = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_LABEL_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


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
    longest = max(map(len, value), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {longest}")
    return value


Stop = Annotated[list[str], BeforeValidator(_stop_list), AfterValidator(_check_stop)]

# a function (tool) name, as OpenAI allows it
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


# --------------------------------------------------------------------------------------------
# Text every surface accepts: valid Unicode scalar values that are not noncharacters
# --------------------------------------------------------------------------------------------
# A lone surrogate cannot be encoded (the tokenizer, the JSON encoder of a response and the
# logs all fail on it, as 500s); noncharacters are for a process's internal use, and the chat
# renderer marks user text with them (engine/chat_template.py), so none may come in.
_BMP_UNSAFE = re.compile("[\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]")
# (astral characters in a character class make re slow on every string: searched apart, only
# in strings that have astral characters at all)
_ASTRAL_UNSAFE = re.compile("|".join(
    f"{chr(plane << 16 | 0xFFFE)}|{chr(plane << 16 | 0xFFFF)}" for plane in range(1, 17)))


def unsafe_char(text: str) -> str | None:
    """The first surrogate or noncharacter in ``text`` (None for most text, quickly)."""
    if text.isascii():
        return None
    found = _BMP_UNSAFE.search(text)
    if found is None and max(text) > "\uffff":
        found = _ASTRAL_UNSAFE.search(text)
    return found.group() if found else None


def escape_unsafe(text: str) -> str:
    """``text`` with surrogates and noncharacters written as ``\\uXXXX`` (safe to echo)."""
    return "".join(f"\\u{ord(c):04x}" if unsafe_char(c) else c for c in text)


def find_unsafe_text(value: Any) -> tuple[str, str] | None:
    """The first string (or object key) under ``value`` holding a surrogate or noncharacter:
    ``(path like messages[0].content, the character)``, or None. Iterative: JSON nests deep."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if found := unsafe_char(item):
                return path, found
        elif isinstance(item, dict):
            for key, sub in reversed(item.items()):
                name = escape_unsafe(str(key))
                where = f"{path}.{name}" if path else name
                if isinstance(key, str) and (found := unsafe_char(key)):
                    return where, found
                stack.append((where, sub))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", sub) for i, sub in reversed(list(enumerate(item))))
    return None


class TextChecked(BaseModel):
    """Base of every request body (each surface's top-level model): one scan of the raw body
    rejects a lone surrogate or a noncharacter in any string field, metadata and keys
    included, as a 400 naming the field (errors.validation_error reads ``param``)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_unsafe_text(data)
        if found is not None:
            path, char = found
            kind = "a lone UTF-16 surrogate" if 0xD800 <= ord(char) <= 0xDFFF else "a noncharacter"
            raise PydanticCustomError(
                "unicode_text", "{detail}",
                {"param": path, "detail": f"it contains {kind} (U+{ord(char):04X}); "
                                          "send valid Unicode text"})
        return data
