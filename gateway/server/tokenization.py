"""Tokenizer calls for the routes, in two lanes of worker threads, client errors mapped to 400s."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prefixgate.engine.api import EngineLike, InvalidRequestError
from prefixgate.engine.tokenizer import PromptTooLongError
from prefixgate.gateway.server.tools import FunctionTool
from prefixgate.gateway.server.tools.dialect import ToolDialect, choose_dialect
from prefixgate.gateway.server.tools.repeats import GuardedParser

T = TypeVar("T")


def template_renders_tools(tokenizer: Any) -> bool:
    """The model's own template writes tools, in a tool-call format the gateway knows
    (tools/formats); otherwise the gateway renders tools itself (tools/prompt.py)."""
    return choose_dialect(getattr(tokenizer, "chat_template", None)).native


def template_inputs(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[FunctionTool] | None,
    message_param: str = "messages",
    dialect: ToolDialect | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to hand the chat template, so that replicas and the router (which
    hashes prompts to place requests) render a conversation with tools identically.
    ``dialect``: the server's (None = the one the template teaches)."""
    if dialect is None:
        dialect = choose_dialect(getattr(tokenizer, "chat_template", None))
    return dialect.template_inputs(messages, tools, message_param)


# Tokens at the end of a prompt that show whether the template opened a reasoning span there.
PROMPT_TAIL_TOKENS = 8


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


LARGE_LANE_NICENESS = 10  # nice(1) increment of the long-prompt lane's threads


def _lower_priority() -> None:
    """Raise the calling thread's niceness (Linux: per thread). Best effort: where the
    platform refuses, the lane runs at normal priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + LARGE_LANE_NICENESS)
    except (AttributeError, OSError):
        pass


class Tokenization:
    """Runs tokenizer calls off the event loop, in two lanes of worker threads: small requests
    never queue behind a long prompt. Chat templates are pure Python (they share the GIL with
    the loop, in slices); the Rust tokenizer releases the GIL (Tokenizer.encode).

    A prompt that provably cannot fit ``capacity`` tokens is refused before it is tokenized
    (and its rendering stops as soon as it cannot fit): every token spells at most
    ``tokenizer.max_token_bytes`` bytes.

    ``tool_call_format``: the ``--tool-call-format`` override (None / ``auto``: the one the
    template teaches); the chosen :class:`ToolDialect` is ``dialect``.
    """

    def __init__(self, engine: EngineLike, capacity: int | None = None,
                 tool_call_format: str | None = None):
        self.engine = engine
        self.capacity = capacity
        self.dialect = choose_dialect(getattr(engine.tokenizer, "chat_template", None),
                                      tool_call_format)
        self._small = ThreadPoolExecutor(WORKERS_PER_LANE, thread_name_prefix="prefixgate-tokenize")
        # the long-prompt lane yields the CPU to everything else: a flood of big prompts
        # then slows only itself, not the event loop, the engine or the small lane
        self._large = ThreadPoolExecutor(WORKERS_PER_LANE,
                                         thread_name_prefix="prefixgate-tokenize-large",
                                         initializer=_lower_priority)

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
        template_kwargs: dict[str, Any] | None = None,
        message_param: str = "messages",
    ) -> list[int]:
        """Token ids of the rendered conversation; errors name ``message_param`` (the surface's
        own field: ``messages``, or ``input`` on Responses)."""
        tokenizer = self.engine.tokenizer
        bounded = functools.partial(tokenizer.apply_chat_template, max_prompt_tokens=self.capacity,
                                    **(template_kwargs or {}))
        try:
            return list(await self.run(bounded, messages, tools, add_generation_prompt,
                                       chars=_text_chars(messages) + _text_chars(tools)))
        except InvalidRequestError:
            raise
        except PromptTooLongError as exc:
            raise self._too_long(exc, message_param) from exc
        except (ValueError, TypeError, KeyError) as exc:
            # Chat templates raise on unsupported role orders etc.; that is the client's input.
            raise InvalidRequestError(
                f"The chat template rejected the messages: {exc}", param=message_param
            ) from exc
        except (RecursionError, MemoryError) as exc:
            # a pathologically nested input: the client's, and it must not become a 500
            raise InvalidRequestError(
                f"The messages are too deeply nested or too large to render ({type(exc).__name__})",
                param=message_param,
            ) from exc

    @property
    def template_renders_tools(self) -> bool:
        return self.dialect.native

    async def chat_with_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[FunctionTool] | None,
        add_generation_prompt: bool,
        message_param: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation whose turns may carry tools, calls and tool results.
        ``template_kwargs``: the request's controls the template reads (``enable_thinking``)."""
        prepared, template_tools = self.dialect.template_inputs(messages, tools, message_param)
        return await self.chat(prepared, template_tools, add_generation_prompt, template_kwargs,
                               message_param)

    def output_parser(self, prompt_ids: Sequence[int], tools: Sequence[FunctionTool] | None,
                      on_repeat: Callable[[], None] | None = None) -> GuardedParser | None:
        """A parser for one choice's output in the model's dialect (tool calls in its format,
        its reasoning span apart); None when the output is plain text. Every API surface gets
        its parser here.

        Args:
            prompt_ids: the prompt (its end shows whether the template opened a reasoning span).
            tools: the tools the model sees (None: calls are not parsed).
            on_repeat: called at a runaway repeated call (tools/repeats.py); None = no guard.
        """
        return self.dialect.parser(tools, on_repeat, self.prompt_tail(prompt_ids))

    def prompt_tail(self, prompt_ids: Sequence[int]) -> str:
        """The end of a prompt as text, where the dialect has a reasoning span the template
        may open there (empty otherwise: nothing reads it)."""
        if self.dialect.reasoning is None or not prompt_ids:
            return ""
        return self.engine.tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), False)

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
