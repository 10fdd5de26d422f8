"""A step's budgets, derived once from the config and the device, and what a chunk costs in
them. Pure arithmetic: no torch (the scheduler imports it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prefixgate.engine.config import (
    EngineConfig,
    decode_token_budget,
    short_prefill_budget,
    step_token_budget,
)


@dataclass(frozen=True, slots=True)
class StepBudgets:
    """What one step may compute (the scheduler's budget rules; docs/scheduling.md).

    Attributes:
        max_num_batched_tokens: a step in which no stream decodes; prefills are chunked to it.
        decode_step_budget: a step while any stream decodes (bounds the inter-token latency);
            None = ``max_num_batched_tokens``.
        short_prefill_budget: a waiting request whose whole prefill costs at most this goes
            first and unsplit (Scheduler._admit_short); None = no widening.
        context_scale: count a prefill chunk's attention (:class:`StepCost`); None = every
            token costs 1.
    """

    max_num_batched_tokens: int = 2048
    decode_step_budget: int | None = None
    short_prefill_budget: int | None = None
    context_scale: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.decode_step_budget is not None and self.decode_step_budget < 1:
            raise ValueError("decode_step_budget must be >= 1")
        if self.context_scale is not None and self.context_scale < 1:
            raise ValueError("context_scale must be >= 1")


def step_budgets(config: EngineConfig, device_type: str, context_scale: int | None) -> StepBudgets:
    """The budgets of ``config`` on ``device_type`` (its per-device defaults filled in).

    ``context_scale``: the model's ``attention_context_scale``; used on CPU only, where steps
    are compute-bound. NOTE: not on GPU until measured there (small-model GPU steps are
    dominated by per-step overhead; smaller long-context chunks could cost more).
    """
    return StepBudgets(
        max_num_batched_tokens=step_token_budget(config, device_type),
        decode_step_budget=decode_token_budget(config, device_type),
        short_prefill_budget=short_prefill_budget(config, device_type),
        context_scale=context_scale if device_type == "cpu" else None,
    )


def settings_as_given(settings: Mapping[str, Any]) -> tuple[EngineConfig, StepBudgets]:
    """A flat mapping of setting names as the config and the budgets, the budgets exactly as
    given (no per-device defaults filled in): scheduling simulations (benchmarks.sched_sim)
    and tests name a policy this way. ``enable_dedup`` is ``enable_prefix_caching``'s other
    name there, ``max_spec_rows`` ``speculative_max_rows``'s."""
    budget_names = {f.name for f in fields(StepBudgets)}
    aliases = {"enable_dedup": "enable_prefix_caching", "max_spec_rows": "speculative_max_rows"}
    config = {aliases.get(k, k): v for k, v in settings.items() if k not in budget_names}
    budgets = {k: v for k, v in settings.items() if k in budget_names}
    return EngineConfig(**config), StepBudgets(**budgets)


class StepCost:
    """Budget units of a prefill chunk: ``n`` tokens from position ``s`` cost
    ``n * (1 + (s + n / 2) / context_scale)`` (the model's ``attention_context_scale``: the
    context at which attention FLOPs equal the linear layers'). A decode token costs 1.
    """

    __slots__ = ("context_scale",)

    def __init__(self, context_scale: int | None) -> None:
        self.context_scale = context_scale

    def cost(self, start: int, n: int) -> float:
        """Budget units of computing ``n`` prompt tokens from position ``start``."""
        if self.context_scale is None:
            return n
        return n * (1 + (start + n / 2) / self.context_scale)

    def fit(self, start: int, remaining: int, budget: float, force_one: bool) -> int:
        """How many of the ``remaining`` tokens from ``start`` fit ``budget``.

        ``force_one``: at least one token even when it costs more than what is left, so the
        first prefill of a step always progresses (deep into a long context one token can
        cost more than a whole budget). Later chunks never take a crumb of leftover budget: a
        long prompt admitted for one token a step would hold its pages and a running slot.
        """
        if remaining <= 0 or (budget <= 0 and not force_one):
            return 0
        if self.context_scale is None:
            n = int(budget)
        else:
            # the largest n with n * (C + start + n / 2) <= budget * C
            c = self.context_scale + start
            n = int(-c + math.sqrt(c * c + 2 * max(budget, 0) * self.context_scale))
            while n > 0 and self.cost(start, n) > budget:  # float rounding
                n -= 1
        return min(remaining, max(n, 1 if force_one else 0))
