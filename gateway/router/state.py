"""The router's serving objects (on ``app.state.router``) and the placement of one request.

Background tasks keep the fleet view current: a /health probe of every replica each
``health_interval_s``, and a heartbeat poll of Redis each ``heartbeat_ttl_s / 3`` (which also
reaps replicas that died without leaving the index).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from prefixgate.gateway.http.auth import KeyTable
from prefixgate.gateway.router.fleet import Fleet, HashFacts, ReplicaState
from prefixgate.gateway.router.index import IndexReader
from prefixgate.gateway.router.metrics import RouterMetrics
from prefixgate.gateway.router.policy import Candidate, Decision, least_loaded, make_policy
from prefixgate.gateway.router.prompt import RESPONSES_PATH, PromptHasher, PromptKey
from prefixgate.gateway.router.recent import RecentRoutes, SessionTable
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.scaleout.background import cancel_and_wait
from prefixgate.gateway.scaleout.keys import RESPONSE_KEY_PREFIX, RedisKeys
from prefixgate.gateway.scaleout.redis_client import REDIS_ERRORS

logger = logging.getLogger("prefixgate.router")


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One placement, kept in a bounded log (tests, debugging) and logged."""

    request_id: str
    replica: str  # name (replica id or host:port)
    url: str
    reason: str
    matched_tokens: int
    prompt_tokens: int
    loads: Mapping[str, int]  # url -> load of every candidate at decision time
    session: str | None
    at: float  # monotonic
    tier_tokens: int = 0  # prompt tokens after ``matched_tokens`` it can load from the fleet tier


class RouterState:
    """Everything one router app holds.

    Args:
        settings: the router settings.
        tokenizer: the replicas' tokenizer; model_id: the replicas' ``LoadedModel.name``.
    """

    def __init__(self, settings: RouterSettings, tokenizer: Any, model_id: str):
        self.settings = settings
        self.keys = KeyTable(settings.api_keys, settings.admin_key)
        self.fleet = Fleet(settings.replicas, HashFacts(model_id, settings.page_size,
                                                        settings.hash_seed, settings.auth_enabled))
        self.hasher = PromptHasher(tokenizer, model_id, settings.page_size, settings.hash_seed,
                                   self.keys, settings.tool_call_format)
        self.policy = make_policy(settings.policy, abs_threshold=settings.balance_abs_threshold,
                                  rel_threshold=settings.balance_rel_threshold,
                                  match_tolerance=settings.match_tolerance, seed=settings.seed)
        self.recent = RecentRoutes(settings.recent_route_ttl_s)
        self.sessions = SessionTable()
        self.index = (IndexReader(settings.redis_url, RedisKeys(settings.namespace),
                                  settings.redis_timeout_s) if settings.redis_url else None)
        self.metrics = RouterMetrics(self.fleet, lambda: self.redis_up)
        self.decisions: deque[DecisionRecord] = deque(maxlen=10_000)
        self.reason_counts: Counter[str] = Counter()
        self.client: httpx.AsyncClient | None = None
        # Tokenising a long chat is milliseconds of pure Python: off the event loop.
        self._hash_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefixgate-hash")
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def redis_up(self) -> bool:
        return self.index is not None and self.index.up

    @property
    def redis_state(self) -> str:
        """``off`` (no --redis-url), ``up`` or ``down``."""
        if self.index is None:
            return "off"
        return "up" if self.redis_up else "down"

    @property
    def cache_aware(self) -> bool:
        return self.policy.name == "cache_aware"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        if self.index is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="router-beats"))
            await self.poll_heartbeats()  # know the fleet before the first request if we can

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)  # bounded even if a library swallows the cancel
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()
        if self.index is not None:
            await self.index.close()
        self._hash_pool.shutdown(wait=False, cancel_futures=True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(r) for r in self.fleet))
            await asyncio.sleep(self.settings.health_interval_s)

    async def probe(self, replica: ReplicaState) -> None:
        """GET /health: reachability and load from our own view."""
        assert self.client is not None
        try:
            response = await self.client.get(
                replica.url + "/health", timeout=max(2.0, 2 * self.settings.health_interval_s))
        except httpx.TimeoutException:
            return  # busy is not dead (a step holds the engine lock); the heartbeat decides
        except httpx.HTTPError as exc:
            replica.mark_down(f"/health: {type(exc).__name__}: {exc}")
            return
        if response.status_code != 200:
            replica.mark_down(f"/health answered HTTP {response.status_code}")
            return
        replica.mark_up()
        try:
            body = response.json()
            replica.report_load(int(body["num_running"]) + int(body["num_waiting"]))
        except (ValueError, KeyError, TypeError) as exc:
            # Not a prefixgate replica's /health: reachable, load from our own in-flight only.
            logger.debug("replica %s: /health without load (%s)", replica.name, exc)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_ttl_s / 3)
            await self.poll_heartbeats()

    async def poll_heartbeats(self) -> None:
        assert self.index is not None
        result = await self.index.heartbeats()
        if result is None:
            return
        beats, registered = result
        ttl = self.settings.heartbeat_ttl_s
        for replica_id in self.fleet.apply_heartbeats(beats, registered, grace_s=ttl):
            await self.index.reap(replica_id, lock_ms=max(1000, round(ttl * 1000)))
            self.fleet.forget_dead(replica_id)

    # ------------------------------------------------------------------ placement

    async def prompt_key(self, path: str, body: bytes, headers: Mapping[str, str]) -> PromptKey | None:
        """Tokenise and hash the prompt (cache-aware policy only; the others ignore it)."""
        if not self.cache_aware:
            return None
        history = await self.stored_history(body, headers) if path == RESPONSES_PATH else None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._hash_pool, self.hasher.key, path, body, headers,
                                          history)

    async def stored_history(self, body: bytes, headers: Mapping[str, str]) -> list | None:
        """A Responses request continuing ``previous_response_id``: the stored conversation
        (shared in Redis by the replicas), so its prompt hashes as the replica will build it
        and the policy sends it where that conversation's pages are."""
        if self.index is None:
            return None
        try:
            data = json.loads(body)
            previous = data.get("previous_response_id") if isinstance(data, dict) else None
            if not isinstance(previous, str) or not previous:
                return None
            raw = await self.index.redis.get(RESPONSE_KEY_PREFIX + previous)
            record = json.loads(raw) if raw else None
        except (*REDIS_ERRORS, ValueError, TypeError) as exc:
            logger.debug("no stored conversation for placement: %s", exc)
            return None
        if not isinstance(record, dict) or record.get("tenant") != self.hasher.tenant_of(headers):
            return None  # another tenant's id: the replica answers it (not found)
        conversation = record.get("conversation")
        return conversation if isinstance(conversation, list) else None

    async def place(self, key: PromptKey | None, salt: str, exclude: frozenset[str] = frozenset()
                    ) -> tuple[ReplicaState, Decision, int, int] | None:
        """Choose a replica: (replica, decision, matched tokens, tokens it can load from the
        fleet tier after those), or None when none is routable."""
        replicas = [r for r in self.fleet.routable(self.redis_up) if r.url not in exclude]
        if not replicas:
            return None
        home = self.sessions.home(key.session) if key is not None else None
        matched = dict.fromkeys((r.url for r in replicas), 0)
        tier = dict.fromkeys((r.url for r in replicas), 0)
        discount = {r.url: r.tier_discount(self.settings.tier_discount) for r in replicas}

        def candidates() -> list[Candidate]:
            return [Candidate(r.url, matched[r.url], r.load, r.url == home, tier[r.url],
                              discount[r.url]) for r in replicas]

        if key is None:
            decision = (self.policy.choose(candidates(), 0, salt) if not self.cache_aware
                        else least_loaded(candidates(), salt, "no_prompt"))
            return self.fleet.get(decision.key), decision, 0, 0
        found: dict[str, int] = {}
        in_tier: dict[str, int] = {}
        if self.index is not None:
            usable = [r for r in replicas if r.replica_id is not None and r.mismatch is None]
            tiered = [r.replica_id for r in usable if discount[r.url] > 0]
            by_id = (await self.index.lookup(key.chain, [r.replica_id for r in usable], tiered)
                     if self.index.up else None)
            if by_id is None:
                decision = least_loaded(candidates(), key.session or salt, "redis_down")
                return self.fleet.get(decision.key), decision, 0, 0
            found = {r.url: by_id.pool[r.replica_id] for r in usable}
            in_tier = {r.url: by_id.tier[r.replica_id] for r in usable}
        # NOTE: no await from here to the caller's record(): a burst of requests sharing a
        # prefix must see each other's placements (recent routes) and in-flight counts.
        blocks = self.recent.matched_blocks(key.chain, matched)
        for url, count in found.items():
            blocks[url] = max(blocks[url], count)
        page = self.settings.page_size
        for url, count in blocks.items():
            matched[url] = min(count * page, key.num_tokens)
            # the tier's run starts after the pool's match the index saw; a longer match from
            # our recent routes covers part of it already
            tier_end = found.get(url, 0) + in_tier.get(url, 0)
            tier[url] = max(0, min(tier_end * page, key.num_tokens) - matched[url])
        decision = self.policy.choose(candidates(), key.num_tokens, key.session or salt)
        return self.fleet.get(decision.key), decision, matched[decision.key], tier[decision.key]

    def record(self, request_id: str, replica: ReplicaState, reason: str, matched: int,
               key: PromptKey | None, loads: Mapping[str, int], tier_tokens: int = 0) -> None:
        """Remember a placement (recent routes, session home), count it, log it."""
        replica.routed += 1
        if key is not None:
            self.recent.record(key.chain, replica.url)
            self.sessions.record(key.session, replica.url)
            self.metrics.prompt_tokens.labels(replica.name).inc(key.num_tokens)
            self.metrics.matched_tokens.labels(replica.name).inc(matched)
            self.metrics.tier_tokens.labels(replica.name).inc(tier_tokens)
        self.metrics.decisions.labels(replica.name, reason).inc()
        self.reason_counts[reason] += 1
        record = DecisionRecord(request_id, replica.name, replica.url, reason, matched,
                                key.num_tokens if key else 0, dict(loads),
                                key.session if key else None, time.monotonic(), tier_tokens)
        self.decisions.append(record)
        logger.info("route %s -> %s (%s; matched %d+%d in tier/%d tokens; loads %s)", request_id,
                    replica.name, reason, matched, tier_tokens, record.prompt_tokens,
                    ",".join(f"{self.fleet.get(u).name}={n}" for u, n in loads.items()))
