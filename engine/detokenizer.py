"""Streaming detokenisation: token ids in, complete text out (no half characters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixgate.engine.tokenizer import Tokenizer


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get text only once it is complete.

    Decoding a growing window and diffing (the vLLM/TGI way) keeps the tokenizer's own rules for
    spaces (sentencepiece strips a leading one) and never emits half of a multi-byte character:
    while the window's text ends in U+FFFD the bytes are held back. :meth:`flush` emits whatever
    is still held (a genuinely invalid byte sequence at the very end).
    """

    # if U+FFFD persists this long it is not a partial character but invalid output
    _MAX_HELD_TOKENS = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded for context only
        self._read_offset = 0  # ids before this were emitted

    @property
    def token_ids(self) -> list[int]:
        """Every id fed so far."""
        return list(self._ids)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is partial)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens
        )
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        held = len(self._ids) - self._read_offset
        if new_text.endswith("\ufffd") and held < self._MAX_HELD_TOKENS:
            return ""
        if len(new_text) <= len(prefix_text):
            # e.g. a skipped special token: nothing to show, but it is consumed
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text of ids still held back (only non-empty when the output ends mid-character)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens
        )
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
