"""Errors raised by cache/. Every one names the problem; none is ever swallowed."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of cache/ errors."""


class InvalidArgumentError(CacheError, ValueError):
    """A size, count or token list that can never be valid (zero pages, empty prompt...)."""


class UnknownSequenceError(CacheError, KeyError):
    """An operation named a sequence id the manager does not hold (never added, or freed)."""

    def __init__(self, seq_id: object, operation: str):
        super().__init__(f"{operation}: unknown sequence id {seq_id!r} (never allocated or already freed)")
        self.seq_id = seq_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class DuplicateSequenceError(CacheError):
    """allocate()/fork() with a sequence id that is already live."""


class OutOfPagesError(CacheError):
    """Not enough free pages for the request; the scheduler should have checked first."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"need {needed} free pages, only {available} available")
        self.needed = needed
        self.available = available


class IntegrityError(CacheError, AssertionError):
    """check_integrity() found a broken invariant (a bug, never a user error)."""
