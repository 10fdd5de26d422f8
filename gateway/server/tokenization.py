"""Tokenizer calls for the routes, on one worker thread, with client errors mapped to 400s."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prefixgate.gateway.engine.api import EngineLike, InvalidRequestError
from prefixgate.gateway.engine.tokenizer import PromptTooLongError
from prefixgate.gateway.server.tools import FunctionTool, native_messages, prepare_messages
from prefixgate.gateway.server.tools.prompt import TOOL_CALL_OPEN, tool_json

T = TypeVar("T")


def template_renders_tools(tokenizer: Any) -> bool:
    """The model's own template writes tools, in the Hermes ``<tool_call>`` format the gateway
    parses; otherwise the gateway renders tools itself (tools/prompt.py)."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(
        template is not None
        and getattr(template, "renders_tools", False)
        and TOOL_CALL_OPEN in template.source
    )


def template_inputs(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[FunctionTool] | None,
    message_param: str = "messages",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to hand the chat template, so that replicas and the router (which
    hashes prompts to place requests) render a conversation with tools identically."""
    if template_renders_tools(tokenizer):
        template_tools = [tool_json(t) for t in tools] if tools else None
        return native_messages(messages, message_param=message_param), template_tools
    return prepare_messages(messages, tools, message_param=message_param), None


# A request whose text is under this many characters takes the small lane (it never waits
# behind a long prompt's rendering and tokenization).
SMALL_REQUEST_CHARS = 64 * 1024
WORKERS_PER_LANE = 2


def _text_chars(value: Any) -> int:
    """Characters of the strings a conversation holds (a cheap size, to pick a lane)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


class Tokenization:
    """Runs tokenizer calls off the event loop, in two lanes of worker threads: small requests
    never queue behind a long prompt. Chat templates are pure Python (they share the GIL with
    the loop, in slices); the Rust tokenizer releases the GIL (Tokenizer.encode).

    A prompt that provably cannot fit ``capacity`` tokens is refused before it is tokenized
    (and its rendering stops as soon as it cannot fit): every token spells at most
    ``tokenizer.max_token_bytes`` bytes.
    """

    def __init__(self, engine: EngineLike, capacity: int | None = None):
        self.engine = engine
        self.capacity = capacity
        self._small = ThreadPoolExecutor(WORKERS_PER_LANE, thread_name_prefix="prefixgate-tokenize")
        self._large = ThreadPoolExecutor(WORKERS_PER_LANE,
                                         thread_name_prefix="prefixgate-tokenize-large")

    async def run(self, fn: Callable[..., T], *args: Any, chars: int = 0) -> T:
        pool = self._small if chars < SMALL_REQUEST_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _too_long(self, exc: PromptTooLongError, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"This model's maximum context length is {self.capacity} tokens, and the prompt "
            f"cannot fit it: {exc}.", param=param, code="context_length_exceeded")

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        tokenizer = self.engine.tokenizer
        bounded = functools.partial(tokenizer.apply_chat_template, max_prompt_tokens=self.capacity)
        try:
            return list(await self.run(bounded, messages, tools, add_generation_prompt,
                                       chars=_text_chars(messages) + _text_chars(tools)))
        except InvalidRequestError:
            raise
        except PromptTooLongError as exc:
            raise self._too_long(exc, "messages") from exc
        except (ValueError, TypeError, KeyError) as exc:
            # Chat templates raise on unsupported role orders etc.; that is the client's input.
            raise InvalidRequestError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc
        except (RecursionError, MemoryError) as exc:
            # a pathologically nested input: the client's, and it must not become a 500
            raise InvalidRequestError(
                f"The messages are too deeply nested or too large to render ({type(exc).__name__})",
                param="messages",
            ) from exc

    @property
    def template_renders_tools(self) -> bool:
        return template_renders_tools(self.engine.tokenizer)

    async def chat_with_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[FunctionTool] | None,
        add_generation_prompt: bool,
        message_param: str = "messages",
    ) -> list[int]:
        """Token ids of a conversation whose turns may carry tools, calls and tool results."""
        prepared, template_tools = template_inputs(self.engine.tokenizer, messages, tools,
                                                   message_param)
        return await self.chat(prepared, template_tools, add_generation_prompt)

    async def text(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        try:
            return list(await self.run(self.engine.tokenizer.encode, text, add_special_tokens,
                                       self.capacity, chars=len(text)))
        except PromptTooLongError as exc:
            raise self._too_long(exc, param) from exc

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Reject ids outside the vocabulary (the model's embedding lookup would fail on them)."""
        vocab_size = getattr(self.engine.tokenizer, "vocab_size", None)  # not in TokenizerLike
        if vocab_size is None:
            return
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param
            )

    async def decode(self, token_ids: Sequence[int]) -> str:
        self.check_token_ids(token_ids, "tokens")
        try:
            return await self.run(self.engine.tokenizer.decode, list(token_ids), False,
                                  chars=len(token_ids))
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            raise InvalidRequestError(
                f"Cannot decode these token ids: {exc}", param="tokens"
            ) from exc

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
