"""Learned retention TTLs: how long a paused agent's prefix is kept, from measured costs.

A response that ends in tool calls is retained (cache/retention.py) because its agent comes back
with the tool's result and resends the whole prefix. How long to hold it is a bet on the pause:
too short and the agent returns to a recompute; too long and the pages sit idle ahead of everyone
else's LRU. Continuum (CacheTTL, arXiv 2511.02230) sets the TTL of a tool-calling request's KV
from the reload cost against the tool-pause distribution; this module does the same, online and
per (tenant, agent):

* **Pauses are measured.** A pause is the time from a response of (tenant, agent) that ended in
  tool calls to that (tenant, agent)'s next request. The last ``window`` pauses of each agent
  are kept (a bounded window follows a drifting tool mix); a pause longer than ``MAX_TTL_S`` is
  recorded as ``MAX_TTL_S`` (the agent came back too late for any TTL, and dropping it would
  bias the quantile down).
* **The TTL covers most returns.** ``margin x`` the ``quantile`` (p90) of the pauses: nine
  returns in ten find their prefix; the margin absorbs the step the returning request waits.
* **A cap from the recompute cost.** Holding pays only while it is cheaper than recomputing: a
  prefix is held at most ``hold_per_recompute`` seconds per second its recompute would cost the
  returning agent (ski rental: rent until the rent paid equals the purchase). Retained pages
  are soft and budgeted, so the rent of a held page is small and the ratio generous (300): it
  only stops a long learned pause from holding a prefix that costs milliseconds to recompute,
  and lets a long prefix be held longer (a 2,048-token prefix at 1 ms/token: 600 s; 64 tokens:
  19 s). The cost per token is measured by :class:`RecomputeCost` from the gateway's own
  time-to-first-token over the tokens it computed (queueing included, which the returning agent
  pays too; Continuum counts it as well); until it has samples it is the documented constant
  ``DEFAULT_RECOMPUTE_S_PER_TOKEN`` (1 ms, a CPU-sized figure; a GPU measures far less).
* **A prior until enough is known.** Before ``min_observations`` (8) pauses of an agent, its
  tenant's pooled pauses decide (new agents of a swarm behave like their siblings); before 8 of
  those, the server's ``--retention`` does, uncapped (the operator's figure).
* The learned TTL stays within ``[MIN_TTL_S, MAX_TTL_S]``; ``prior_s == 0`` turns retention
  off whatever was learned; ``learn=False`` always answers the prior.

Bounded memory: at most ``max_keys`` (tenant, agent) keys and as many tenants, least recently
used dropped first; a dropped agent's pauses live on in its tenant's pooled window (the fold).
An agent label shared by parallel sessions measures shorter pauses than each session has (the
next request may be a sibling's): label sessions apart for a sharper TTL. An agent that never
comes back leaves no pause (its pending end ages out with its key).

Pure Python; the clock is injected for tests.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

MIN_TTL_S = 1.0  # below this holding costs nothing worth saving and a step may take as long
MAX_TTL_S = 3600.0  # the longest retention any hint may ask for
DEFAULT_RECOMPUTE_S_PER_TOKEN = 1e-3  # until measured: ~1 ms of prefill per token (CPU-sized)
HOLD_PER_RECOMPUTE = 300.0  # seconds held per second of recompute saved, at most


class RecomputeCost:
    """Seconds a returning agent waits per recomputed prompt token: the median, over the last
    ``window`` requests that computed at least ``min_tokens`` prompt tokens, of time to first
    token / tokens computed; ``default_s_per_token`` until ``min_samples`` are in."""

    def __init__(self, default_s_per_token: float = DEFAULT_RECOMPUTE_S_PER_TOKEN, *,
                 window: int = 64, min_tokens: int = 64, min_samples: int = 4):
        if default_s_per_token <= 0 or window < 1 or min_samples < 1:
            raise ValueError("default_s_per_token must be > 0, window and min_samples >= 1")
        self.default_s_per_token = default_s_per_token
        self.min_tokens = min_tokens
        self.min_samples = min_samples
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float, computed_tokens: int) -> None:
        """One request's prefill: ``seconds`` to its first token for ``computed_tokens``."""
        if computed_tokens >= self.min_tokens and seconds > 0 and math.isfinite(seconds):
            self._samples.append(seconds / computed_tokens)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def s_per_token(self) -> float:
        if len(self._samples) < self.min_samples:
            return self.default_s_per_token
        return statistics.median(self._samples)

    def seconds(self, num_tokens: int) -> float:
        """What recomputing ``num_tokens`` prompt tokens costs the returning agent."""
        return self.s_per_token * max(0, num_tokens)


class TTLDecision(NamedTuple):
    ttl_s: float
    source: str  # "prior" | "agent" | "tenant" (whose pauses decided) | "off"
    pause_quantile_s: float | None  # the learned pause quantile (None under the prior)
    cap_s: float | None  # the recompute-cost cap (None under the prior)


@dataclass(slots=True)
class _Pauses:
    window: deque[float]
    ended_at: float | None = None  # when its last response ended in tool calls (pause running)


@dataclass(frozen=True, slots=True)
class AgentPauses:
    """What the policy knows of one (tenant, agent), for stats."""

    num_pauses: int
    pause_quantile_s: float | None  # None before min_observations
    ttl_s: float  # the default TTL it gets now, before each prefix's recompute-cost cap
    source: str


@dataclass(slots=True)
class TTLPolicy:
    """Learns each (tenant, agent)'s tool-pause distribution online and answers the default TTL
    (module docstring for the policy).

    Args:
        prior_s: the TTL before enough pauses are known (the server's ``--retention``); 0 = off.
        learn: False = always ``prior_s``.
        recompute: the measured recompute cost (a fresh default-constant one if None).
        clock: monotonic seconds (injected in tests).
        min_observations, quantile, margin, window: the learning (module docstring).
        max_keys: (tenant, agent) keys tracked at most (and tenants), LRU first out.
        hold_per_recompute: the cap's ratio of seconds held to seconds of recompute saved.
    """

    prior_s: float
    learn: bool = True
    recompute: RecomputeCost = field(default_factory=RecomputeCost)
    clock: Callable[[], float] = time.monotonic
    min_observations: int = 8
    quantile: float = 0.9
    margin: float = 1.25
    window: int = 64
    max_keys: int = 4096
    hold_per_recompute: float = HOLD_PER_RECOMPUTE
    _agents: OrderedDict[tuple[str, str], _Pauses] = field(default_factory=OrderedDict, init=False)
    _tenants: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.prior_s <= MAX_TTL_S:
            raise ValueError(f"prior_s must be in [0, {MAX_TTL_S:g}], got {self.prior_s}")
        if not 0 < self.quantile <= 1 or self.margin < 1 or self.window < 1:
            raise ValueError("quantile must be in (0, 1], margin >= 1, window >= 1")
        if self.min_observations < 1 or self.max_keys < 1 or self.hold_per_recompute <= 0:
            raise ValueError("min_observations and max_keys must be >= 1, hold_per_recompute > 0")

    # ------------------------------------------------------------------ observations

    def tool_call_ended(self, tenant: str, agent: str | None) -> None:
        """A response of (tenant, agent) ended in tool calls: its pause starts now."""
        if agent is not None and self.learn:
            self._agent(tenant, agent).ended_at = self.clock()

    def request_arrived(self, tenant: str, agent: str | None) -> float | None:
        """(tenant, agent) sent a request: ends its running pause, if any, and learns it.

        Returns:
            The pause observed (seconds, clamped to ``MAX_TTL_S``), or None.
        """
        if agent is None or not self.learn:
            return None
        state = self._agents.get((tenant, agent))
        if state is None or state.ended_at is None:
            return None
        self._agents.move_to_end((tenant, agent))
        pause = min(max(0.0, self.clock() - state.ended_at), MAX_TTL_S)
        state.ended_at = None
        state.window.append(pause)
        self._tenant(tenant).append(pause)
        return pause

    # ------------------------------------------------------------------ decisions

    def ttl(self, tenant: str, agent: str | None, num_tokens: int) -> float:
        """The default TTL for a prefix of ``num_tokens`` tokens that (tenant, agent) paused on."""
        return self.decide(tenant, agent, num_tokens).ttl_s

    def decide(self, tenant: str, agent: str | None, num_tokens: int | None) -> TTLDecision:
        """:meth:`ttl` with its reasons (``num_tokens=None``: before the recompute-cost cap)."""
        if self.prior_s <= 0:
            return TTLDecision(0.0, "off", None, None)
        source, pauses = self._evidence(tenant, agent)
        if pauses is None:
            return TTLDecision(self.prior_s, "prior", None, None)
        quantile = self._quantile(pauses)
        cap = self.cap(num_tokens) if num_tokens is not None else MAX_TTL_S
        ttl = min(max(min(self.margin * quantile, cap), MIN_TTL_S), MAX_TTL_S)
        return TTLDecision(ttl, source, quantile, cap)

    def cap(self, num_tokens: int) -> float:
        """The longest a learned TTL may hold a prefix of ``num_tokens``: ``hold_per_recompute``
        x its measured recompute seconds, within [MIN_TTL_S, MAX_TTL_S]."""
        held = self.hold_per_recompute * self.recompute.seconds(num_tokens)
        return min(max(held, MIN_TTL_S), MAX_TTL_S)

    def agents(self, tenant: str) -> dict[str, AgentPauses]:
        """What is known of each tracked agent of ``tenant`` (for stats)."""
        out = {}
        for (owner, agent), state in self._agents.items():
            if owner != tenant:
                continue
            decision = self.decide(tenant, agent, None)
            known = len(state.window) >= self.min_observations
            out[agent] = AgentPauses(len(state.window),
                                     self._quantile(state.window) if known else None,
                                     decision.ttl_s, decision.source)
        return out

    @property
    def num_tracked(self) -> int:
        return len(self._agents)

    def tenants(self) -> list[str]:
        """Tenants with a tracked agent."""
        return sorted({tenant for tenant, _ in self._agents})

    # ------------------------------------------------------------------ internals

    def _evidence(self, tenant: str, agent: str | None) -> tuple[str, deque[float] | None]:
        if not self.learn:
            return "prior", None
        if agent is not None:
            state = self._agents.get((tenant, agent))
            if state is not None and len(state.window) >= self.min_observations:
                return "agent", state.window
        pooled = self._tenants.get(tenant)
        if pooled is not None and len(pooled) >= self.min_observations:
            return "tenant", pooled
        return "prior", None

    def _quantile(self, pauses: deque[float]) -> float:
        ordered = sorted(pauses)
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]  # nearest rank

    def _agent(self, tenant: str, agent: str) -> _Pauses:
        key = (tenant, agent)
        state = self._agents.get(key)
        if state is None:
            state = self._agents[key] = _Pauses(deque(maxlen=self.window))
            while len(self._agents) > self.max_keys:
                self._agents.popitem(last=False)  # its pauses stay in the tenant's window
        self._agents.move_to_end(key)
        return state

    def _tenant(self, tenant: str) -> deque[float]:
        pooled = self._tenants.get(tenant)
        if pooled is None:
            pooled = self._tenants[tenant] = deque(maxlen=4 * self.window)
            while len(self._tenants) > self.max_keys:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(tenant)
        return pooled
