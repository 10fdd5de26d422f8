"""What the engine keeps per request and per choice (besides the scheduler's Sequence)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prefixgate.engine.api import Delta, EngineError, GenerationRequest
from prefixgate.engine.grammar import CompiledGrammar, Matcher
from prefixgate.engine.sequence import Sequence
from prefixgate.engine.stop_strings import StopStringMatcher

Sink = Callable[[Delta | EngineError], None]


class DecoderLike(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(slots=True)
class DecodeState:
    """One choice's output side: detokenizer, stop strings, sampling noise, grammar."""

    decoder: DecoderLike
    stops: StopStringMatcher
    generator: torch.Generator | None
    matcher: Matcher | None = None  # a constrained row: its grammar state


@dataclass(slots=True)
class RequestState:
    """One request: where its deltas go, its choices' sequences, its cache keys."""

    request: GenerationRequest
    sink: Sink
    extra_keys: bytes
    seqs: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    pin_when_done: bool = False
    grammar: CompiledGrammar | None = None
