"""The engine's running totals, fed once per step (EngineStats and /metrics read them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# a step with at least this many tokens is prefill-sized: its time per token is what a
# recompute costs, the figure a tier hit is weighed against
PREFILL_SIZED_STEP = 32


@dataclass(slots=True)
class StepCounters:
    num_steps: int = 0  # non-empty steps
    prefill_tokens_computed: int = 0  # prompt tokens run through the model (not cache hits)
    decode_tokens: int = 0  # generated tokens run through the model
    constrained_tokens: int = 0  # tokens a grammar accepted
    tier_tokens_loaded: int = 0  # prompt tokens loaded from the second tier, not recomputed
    spec_tokens_accepted: int = 0  # draft tokens emitted (speculative decoding)
    seconds_per_token: float = 0.0  # moving average of a prefill-sized step's time per token

    def count_chunks(self, chunks: Iterable[Any]) -> None:
        """Split the step's computed tokens into prompt (prefill) and generated (decode) ones."""
        for c in chunks:
            prompt, start = c.seq.num_prompt_tokens, c.start_pos
            if prompt > start:
                self.prefill_tokens_computed += min(c.num_tokens, prompt - start)
            self.decode_tokens += max(0, start + c.num_tokens - max(start, prompt))

    def time_forward(self, num_tokens: int, seconds: float) -> None:
        """Fold a prefill-sized step's forward time into ``seconds_per_token``."""
        if num_tokens < PREFILL_SIZED_STEP:
            return
        per_token = seconds / num_tokens
        self.seconds_per_token = per_token if not self.seconds_per_token else (
            0.9 * self.seconds_per_token + 0.1 * per_token)


def counter(name: str) -> property:
    """A read-only attribute of the engine that is one of its StepCounters' fields."""
    return property(lambda self: getattr(self.counters, name), doc=f"StepCounters.{name}")
