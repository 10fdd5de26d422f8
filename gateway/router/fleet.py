"""The router's view of its replicas: reachability, heartbeats, load.

Load is our own in-flight count (exact, immediate) plus what other routers add, estimated from
the replica's last reported running + waiting minus our in-flight at that moment. Reports come
from our /health probes; heartbeat loads (sampled up to an interval earlier) fill in only while
probes do not answer, so an older figure never overwrites a newer one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prefixgate.gateway.router.settings import normalize_url
from prefixgate.gateway.scaleout.heartbeat import Heartbeat

logger = logging.getLogger("prefixgate.router")


@dataclass(frozen=True, slots=True)
class HashFacts:
    """What the router hashes with; a replica reporting different facts gets no affinity."""

    model_id: str
    page_size: int
    hash_seed: int
    auth_enabled: bool


@dataclass(slots=True)
class ReplicaState:
    url: str
    replica_id: str | None = None  # from its heartbeat
    reachable: bool = True  # own view: probes and proxied requests (optimistic at start)
    heartbeat: Heartbeat | None = None
    heartbeat_seen: bool = False  # it publishes: an expired heartbeat then means gone
    heartbeat_fresh: bool = False
    inflight: int = 0  # requests we proxied to it that have not finished
    other_load: int = 0
    probed_at: float = -1e9  # monotonic time of the last /health load report
    routed: int = 0  # requests we placed on it
    last_error: str | None = None
    mismatch: str | None = None  # why its index cannot be used (hashing facts differ)

    @property
    def name(self) -> str:
        """Label for logs and metrics: the replica id, else host:port."""
        return self.replica_id or self.url.split("://", 1)[-1]

    @property
    def load(self) -> int:
        return self.inflight + self.other_load

    @property
    def heartbeat_state(self) -> str:
        """``fresh``, ``expired`` (it published, then stopped) or ``none`` (never seen)."""
        if self.heartbeat_fresh:
            return "fresh"
        return "expired" if self.heartbeat_seen else "none"

    def tier_discount(self, prior: float) -> float:
        """What a block of the fleet's Redis tier is worth here, in cached blocks: 0 unless its
        heartbeat says it loads from that tier; then its measured figure, else ``prior``."""
        beat = self.heartbeat
        if beat is None or beat.kv_tier != "redis" or not prior:
            return 0.0
        return prior if beat.tier_discount is None else float(beat.tier_discount)

    def routable(self, redis_up: bool) -> bool:
        if not self.reachable:
            return False
        # Without Redis the heartbeat is unknown, not expired.
        return not (redis_up and self.heartbeat_seen and not self.heartbeat_fresh)

    def report_load(self, running_and_waiting: int, *, probed: bool = True) -> None:
        """A load report from the replica: a /health probe, or a heartbeat (``probed=False``,
        ignored while probes answer)."""
        now = time.monotonic()
        if probed:
            self.probed_at = now
        elif now - self.probed_at < 5.0:
            return
        self.other_load = max(0, running_and_waiting - self.inflight)

    def mark_down(self, error: str) -> None:
        if self.reachable:
            logger.warning("replica %s (%s) is down: %s", self.name, self.url, error)
        self.reachable = False
        self.last_error = error

    def mark_up(self) -> None:
        if not self.reachable:
            logger.info("replica %s (%s) is back", self.name, self.url)
        self.reachable = True


class Fleet:
    """Every configured replica, by URL, in the order given."""

    def __init__(self, urls: Iterable[str], facts: HashFacts):
        self.replicas: dict[str, ReplicaState] = {url: ReplicaState(url) for url in urls}
        self.facts = facts
        self._unknown_logged: set[str] = set()
        self._missing_since: dict[str, float] = {}

    def __iter__(self):
        return iter(self.replicas.values())

    def get(self, url: str) -> ReplicaState:
        return self.replicas[url]

    def routable(self, redis_up: bool) -> list[ReplicaState]:
        """Replicas to send traffic to. When every heartbeat looks expired but replicas answer
        (Redis just restarted or was flushed, nobody re-published yet), the reachable ones:
        serving beats refusing."""
        live = [r for r in self.replicas.values() if r.routable(redis_up)]
        return live or [r for r in self.replicas.values() if r.reachable]

    def apply_heartbeats(self, beats: Mapping[str, Heartbeat], registered: Iterable[str],
                         now: float | None = None, grace_s: float = 0.0) -> list[str]:
        """Fold a heartbeat poll in; returns registered ids dead for longer than ``grace_s``
        (the janitor removes their index entries)."""
        now = time.monotonic() if now is None else now
        fresh_urls = set()
        for replica_id, beat in beats.items():
            try:
                url = normalize_url(beat.url)
            except ValueError:
                url = beat.url
            replica = self.replicas.get(url)
            if replica is None:
                if replica_id not in self._unknown_logged:
                    self._unknown_logged.add(replica_id)
                    logger.warning("replica %s publishes %s, which is not a --replica of this "
                                   "router; ignored", replica_id, beat.url)
                continue
            fresh_urls.add(url)
            if replica.replica_id != replica_id:
                replica.replica_id = replica_id
            replica.heartbeat = beat
            replica.heartbeat_seen = True
            replica.report_load(beat.load, probed=False)
            self._check_facts(replica, beat)
        for replica in self.replicas.values():
            was_fresh = replica.heartbeat_fresh
            replica.heartbeat_fresh = replica.url in fresh_urls
            if was_fresh and not replica.heartbeat_fresh:
                logger.warning("replica %s: heartbeat expired; no longer routed to", replica.name)
        dead = []
        for replica_id in registered:
            if replica_id in beats:
                self._missing_since.pop(replica_id, None)
                continue
            since = self._missing_since.setdefault(replica_id, now)
            if now - since >= grace_s:
                dead.append(replica_id)
        return dead

    def forget_dead(self, replica_id: str) -> None:
        self._missing_since.pop(replica_id, None)

    def _check_facts(self, replica: ReplicaState, beat: Heartbeat) -> None:
        facts = self.facts
        problems = []
        if beat.model_id != facts.model_id:
            problems.append(f"model id {beat.model_id!r} != router's {facts.model_id!r}")
        if beat.page_size != facts.page_size:
            problems.append(f"page size {beat.page_size} != router's {facts.page_size}")
        if beat.hash_seed != facts.hash_seed:
            problems.append(f"hash seed {beat.hash_seed} != router's {facts.hash_seed}")
        if beat.auth_enabled != facts.auth_enabled:
            problems.append("API keys are configured on one side only (tenants differ)")
        mismatch = "; ".join(problems) or None
        if mismatch != replica.mismatch and mismatch is not None:
            logger.error("replica %s hashes differently (%s): routed by load only; give the "
                         "router the replicas' --model/--page-size/--hash-seed/--api-key",
                         replica.name, mismatch)
        replica.mismatch = mismatch
