"""Tokenizer calls for the routes, on one worker thread, with client errors mapped to 400s."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prefixgate.gateway.engine.api import EngineLike, InvalidRequestError

T = TypeVar("T")


class Tokenization:
    """Runs tokenizer calls on one worker thread: chat templates of long prompts take
    milliseconds of pure Python, which must not stall every other stream on the event loop."""

    def __init__(self, engine: EngineLike):
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixgate-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        tokenizer = self.engine.tokenizer
        try:
            return list(
                await self.run(
                    tokenizer.apply_chat_template, messages, tools, add_generation_prompt
                )
            )
        except (ValueError, TypeError, KeyError) as exc:
            # Chat templates raise on unsupported role orders etc.; that is the client's input.
            raise InvalidRequestError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc

    async def text(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(await self.run(self.engine.tokenizer.encode, text, add_special_tokens))

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
            return await self.run(self.engine.tokenizer.decode, list(token_ids), False)
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            raise InvalidRequestError(
                f"Cannot decode these token ids: {exc}", param="tokens"
            ) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
