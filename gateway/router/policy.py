"""Where a request goes: cache affinity against load, as pure functions over candidates.

Cache-aware placement, in order:

1. **Load guard.** A replica whose load exceeds the least-loaded one's by at least
   ``abs_threshold`` requests AND is at least ``rel_threshold`` times it takes no affinity
   traffic. This is what stops a prefix every request shares (one system prompt for the whole
   swarm) from piling everything onto the replica that computed it first.
2. **Prefix.** Among the rest, the longest matched prefix wins — unless other replicas match
   within ``match_tolerance`` of the prompt: equal matches carry no information, so
3. **load** decides between them, then
4. **session** affinity (the replica this ``user`` / ``X-Agent-Id`` went to last), then
5. a **hash** of the session (or prompt) over the replica keys, so ties spread evenly and
   the same session lands on the same replica.

With no match anywhere the least-loaded replica wins (session, then hash, break ties).

A match is the replica's own cached tokens plus, for replicas that load from the fleet's
Redis KV tier, the tier's tokens after those, discounted by what loading costs there
(``Candidate.score``). A prefix every replica can load adds about the same to each, so it
lifts them above replicas that cannot load it and otherwise leaves load to decide.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class Candidate(NamedTuple):
    """One routable replica as the policy sees it."""

    key: str  # the replica URL
    matched_tokens: int  # leading prompt tokens it holds in cache
    load: int  # requests it is working on (running + waiting), our best estimate
    is_session_home: bool = False  # the session's previous request went there
    tier_tokens: int = 0  # prompt tokens after those it could load from the fleet's KV tier
    tier_discount: float = 0.0  # the fraction of a recompute such a loaded token saves there

    @property
    def score(self) -> float:
        """Prompt tokens it need not compute: its own pool's, plus the tier's at a discount
        (loading costs something; a replica measures how much and reports it)."""
        return self.matched_tokens + self.tier_discount * self.tier_tokens


class Decision(NamedTuple):
    key: str
    reason: str  # one of REASONS


REASONS: tuple[str, ...] = (
    "prefix",  # longest matched prefix
    "load",  # matches about equal: the less loaded one
    "session",  # matches and loads equal: where the session went before
    "hash",  # all equal: hash of the session / prompt
    "least_loaded",  # nothing cached anywhere
    "load_guard",  # the best match was overloaded; the least loaded took it
    "only_replica",
    "redis_down",  # no index: least loaded from our own view
    "no_prompt",  # not a completion (tokenize, ...) or unparsable: least loaded
    "round_robin",
    "random",
    "retry",  # the first choice refused the connection
)


def _tiebreak(key: str, salt: str) -> bytes:
    return hashlib.blake2b(f"{salt}\x00{key}".encode(), digest_size=8).digest()


def least_loaded(candidates: Sequence[Candidate], salt: str, reason: str) -> Decision:
    """Lowest load; ties go to the session's home, then to a hash of ``salt``."""
    low = min(c.load for c in candidates)
    tied = [c for c in candidates if c.load == low]
    if len(tied) == 1:
        return Decision(tied[0].key, reason)
    home = [c for c in tied if c.is_session_home]
    if home:
        return Decision(home[0].key, reason)
    return Decision(max(tied, key=lambda c: _tiebreak(c.key, salt)).key, reason)


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int, salt: str) -> Decision:
        """Pick one of ``candidates`` (non-empty) for a prompt of ``prompt_tokens`` tokens."""
        ...


@dataclass(frozen=True, slots=True)
class CacheAwarePolicy:
    """See the module docstring. ``salt`` is the session id, else something of the prompt."""

    abs_threshold: int = 4
    rel_threshold: float = 1.5
    match_tolerance: float = 0.02
    name: str = "cache_aware"

    def overloaded(self, candidate: Candidate, min_load: int) -> bool:
        return (candidate.load - min_load >= self.abs_threshold
                and candidate.load >= self.rel_threshold * min_load)

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int, salt: str) -> Decision:
        if not candidates:
            raise ValueError("no candidate replica to choose from")
        if len(candidates) == 1:
            return Decision(candidates[0].key, "only_replica")
        min_load = min(c.load for c in candidates)
        eligible = [c for c in candidates if not self.overloaded(c, min_load)]
        best_any = max(c.score for c in candidates)
        best = max(c.score for c in eligible)
        if best == 0:
            reason = "load_guard" if best_any > 0 else "least_loaded"
            return least_loaded(eligible, salt, reason)
        tolerance = self.match_tolerance * prompt_tokens
        near = [c for c in eligible if c.score >= best - tolerance]
        guarded = best_any > best  # a better match exists on an overloaded replica
        if len(near) == 1:
            return Decision(near[0].key, "load_guard" if guarded else "prefix")
        low = min(c.load for c in near)
        tied = [c for c in near if c.load == low]
        if len(tied) == 1:
            return Decision(tied[0].key, "load_guard" if guarded else "load")
        home = [c for c in tied if c.is_session_home]
        if home:
            return Decision(home[0].key, "session")
        top = max(c.score for c in tied)
        longest = [c for c in tied if c.score == top]
        if len(longest) == 1:
            return Decision(longest[0].key, "prefix")
        return Decision(max(longest, key=lambda c: _tiebreak(c.key, salt)).key, "hash")


@dataclass(slots=True)
class RoundRobinPolicy:
    """Cycles through the candidates in key order (a baseline for benchmarks)."""

    name: str = "round_robin"
    _next: int = 0

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int, salt: str) -> Decision:
        if not candidates:
            raise ValueError("no candidate replica to choose from")
        ordered = sorted(candidates, key=lambda c: c.key)
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(choice.key, "round_robin")


@dataclass(slots=True)
class RandomPolicy:
    """Uniformly random (a baseline for benchmarks); seeded for repeatable runs."""

    seed: int = 0
    name: str = "random"
    _rng: random.Random | None = None

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int, salt: str) -> Decision:
        if not candidates:
            raise ValueError("no candidate replica to choose from")
        if self._rng is None:
            self._rng = random.Random(self.seed)
        ordered = sorted(candidates, key=lambda c: c.key)
        return Decision(self._rng.choice(ordered).key, "random")


def make_policy(name: str, *, abs_threshold: int = 4, rel_threshold: float = 1.5,
                match_tolerance: float = 0.02, seed: int = 0) -> Policy:
    """The policy called ``name`` (cache_aware, round_robin, random)."""
    if name == "cache_aware":
        return CacheAwarePolicy(abs_threshold, rel_threshold, match_tolerance)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown routing policy {name!r} (cache_aware, round_robin, random)")
