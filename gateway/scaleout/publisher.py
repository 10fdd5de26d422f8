"""The replica side of scale-out: publish this replica's block index, load and stats to Redis.

One background task on the server's event loop does all Redis I/O:

* every ``flush_interval_s`` it drains the cache events queued by the engine thread (see
  :class:`EventBuffer`), coalesces them and writes them in one pipeline;
* every ``heartbeat_ttl_s / 3`` it writes the heartbeat (load, pages, hashing facts; expires
  after the TTL) and, when they changed, this process's cumulative hit counters (see
  :mod:`gateway.scaleout.fleet_stats`), in one transaction;
* the beat's load comes from lock-free counters (``AsyncEngine.load_estimate``): a step holds
  the engine lock as long as it runs and Python locks are not fair, so a locked snapshot can
  wait many steps under load. A second task takes the locked stats snapshots for the fleet
  counters at its own pace. Only an engine that has work but takes no step for
  ``stuck_engine_s`` stops the beats (the router then stops sending it traffic);
* at start, after any failed write, after the event queue overflowed, when a router's
  janitor removed us, and when Redis lost index keys behind our back (an ``allkeys-*``
  eviction, a DEL: every beat audits the index, :meth:`IndexWriter.audit`), it resynchronises
  the full index from the engine's cached hashes. A stats snapshot Redis lost is written again
  at the next beat.

Requests never wait on Redis: the engine thread only appends to a deque. If Redis is down the
replica keeps serving, the queue is discarded (the next resync covers it), and publication
resumes by itself when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from prefixgate.cache.stats import CacheStats
from prefixgate.gateway.scaleout.background import cancel_and_wait, cancel_requested
from prefixgate.gateway.scaleout.event_buffer import EventBuffer
from prefixgate.gateway.scaleout.fleet_stats import queue_snapshot, snapshot_json
from prefixgate.gateway.scaleout.heartbeat import Heartbeat
from prefixgate.gateway.scaleout.index_writer import IndexWriter, coalesce
from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE, RedisKeys
from prefixgate.gateway.scaleout.redis_client import REDIS_ERRORS, connect, describe

logger = logging.getLogger("prefixgate.scaleout")

_REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Where and how often a replica publishes (CLI: --redis-url, --replica-id,
    --advertise-url, --heartbeat-ttl)."""

    redis_url: str
    replica_id: str
    advertise_url: str  # the URL routers use to reach this replica
    heartbeat_ttl_s: float = 3.0
    flush_interval_s: float = 0.02
    namespace: str = DEFAULT_NAMESPACE
    max_events_per_flush: int = 50_000
    max_pending_events: int = 200_000  # beyond: drop the queue and resync instead
    redis_timeout_s: float = 1.0
    stuck_engine_s: float = 60.0  # work queued but no step for this long: stop beating

    def __post_init__(self) -> None:
        if not _REPLICA_ID_RE.match(self.replica_id):
            raise ValueError(
                f"invalid replica id {self.replica_id!r} (1-128 characters from A-Z a-z 0-9 . _ : @ -)"
            )
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        if not self.advertise_url.startswith(("http://", "https://")):
            raise ValueError(f"--advertise-url must be an http(s) URL, got {self.advertise_url!r}")
        if self.heartbeat_ttl_s <= 0 or self.flush_interval_s <= 0 or self.redis_timeout_s <= 0:
            raise ValueError("heartbeat TTL, flush interval and Redis timeout must be > 0")

    @property
    def heartbeat_interval_s(self) -> float:
        # Three beats per TTL: one lost beat never makes a live replica look dead.
        return self.heartbeat_ttl_s / 3


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname()}-{port}"


def default_advertise_url(host: str, port: int) -> str:
    """``http://host:port``; a wildcard bind address is replaced by this machine's hostname."""
    if port == 0:
        raise ValueError("--redis-url needs --advertise-url (or a fixed --port): port 0 is unknown")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


@dataclass(slots=True)
class PublisherStatus:
    """Counters for tests and logs."""

    connected: bool = False
    resyncs: int = 0
    events_published: int = 0
    beats: int = 0
    failures: int = 0
    last_error: str | None = None
    index_repairs: int = 0  # resyncs because Redis lost index keys (eviction, DEL)


class ReplicaPublisher:
    """Publishes one engine's index, heartbeat and stats.

    Args:
        engine: an :class:`engine.async_engine.AsyncEngine` (needs ``add_event_sink``,
            ``cached_block_hashes``, ``engine_stats``, ``cache_stats`` and the hashing facts
            ``model_id``, ``page_size``, ``hash_seed``).
        config: where and how often.
        served_model: the OpenAI model name (for the router's /v1/models fallback).
        auth_enabled: whether the replica wants API keys (the router warns if it has none).
        clients: the server's client counters (``ClientCounters.snapshot``), published with
            the hit counters so the router sums them over the fleet; called on the event loop.
    """

    def __init__(self, engine: Any, config: PublisherConfig, *, served_model: str,
                 auth_enabled: bool = False,
                 clients: Callable[[], Mapping[str, int]] | None = None):
        missing = [name for name in ("add_event_sink", "cached_block_hashes", "load_estimate",
                                     "model_id", "page_size", "hash_seed")
                   if not hasattr(engine, name)]
        if missing:
            raise TypeError(f"this engine cannot publish a cache index (lacks {', '.join(missing)})")
        self.engine = engine
        self.config = config
        self.served_model = served_model
        self.auth_enabled = auth_enabled
        self.clients = clients
        self.keys = RedisKeys(config.namespace)
        self.buffer = EventBuffer(config.max_pending_events)
        self.status = PublisherStatus()
        self.redis: Any = None
        self.writer: IndexWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._dirty = True  # the index needs a full resync before deltas mean anything
        self._policy_checked = False  # Redis's maxmemory-policy, read at the first resync
        self._started_at = time.time()
        # Pool size and queue bound never change: read once, before the engine runs.
        self._num_pages = engine.cache_stats().num_pages
        self._max_waiting = engine.engine_stats().max_waiting
        self._cache_sample: CacheStats | None = None  # latest locked snapshot (fleet stats)
        self._stats_written: bytes | None = None  # the counters Redis holds from us
        self._epoch = str(round(self._started_at * 1000))  # this process's stats key
        self._sampler: asyncio.Task[None] | None = None
        self._stopping = False  # the loops' own stop flag (background.py: why not cancel alone)
        self._audit_cursor = 0  # where the rotating check of our block keys goes on
        self._last_steps = (-1, time.monotonic())  # (steps taken, when that count was first seen)

    async def start(self) -> None:
        """Attach to the engine's event stream and start the background task (no I/O here)."""
        if self._task is not None:
            return
        self._stopping = False
        self.engine.add_event_sink(self.buffer)
        self.redis = connect(self.config.redis_url, timeout_s=self.config.redis_timeout_s)
        self.writer = IndexWriter(self.redis, self.keys, self.config.replica_id)
        self._sampler = asyncio.create_task(self._sample_loop(), name="prefixgate-sampler")
        self._task = asyncio.create_task(self._run(), name="prefixgate-publisher")
        logger.info("publishing cache index as %s (%s) to %s", self.config.replica_id,
                    self.config.advertise_url, self.config.redis_url)

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Stop publishing and remove this replica from the index (best effort)."""
        if self._task is None:
            return
        self.buffer.close()
        self._stopping = True
        await cancel_and_wait((self._task, self._sampler), grace_s=timeout_s)
        self._task = self._sampler = None
        assert self.writer is not None
        try:
            removed = await asyncio.wait_for(self.writer.remove(), timeout_s)
            logger.info("replica %s left the index (%d blocks)", self.config.replica_id, removed)
        except REDIS_ERRORS as exc:
            # Its heartbeat expires by itself; a router's janitor removes the blocks later.
            logger.warning("could not remove replica %s from Redis: %s", self.config.replica_id,
                           describe(exc))
        finally:
            try:
                await asyncio.wait_for(self.redis.aclose(), timeout_s)
            except (*REDIS_ERRORS, TimeoutError) as exc:
                logger.warning("closing replica %s's Redis connections: %s",
                               self.config.replica_id, describe(exc))

    @property
    def dirty(self) -> bool:
        return self._dirty or self.buffer.overflowed

    async def _run(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_beat = 0.0
        while not self._stopping:
            try:
                if self.dirty:
                    await self._resync()
                await self._flush()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + interval
                    await self._beat()
                self._up()
                await asyncio.sleep(self.config.flush_interval_s)
            except REDIS_ERRORS as exc:
                if cancel_requested():  # the library's error may be our cancellation
                    raise
                self._down(describe(exc))
                await asyncio.sleep(interval)
            except Exception as exc:  # a bug here must not take the replica down
                if cancel_requested():
                    raise
                logger.exception("index publisher failed; resynchronising")
                self._down(describe(exc))
                await asyncio.sleep(interval)

    async def _sample_loop(self) -> None:
        while not self._stopping:
            self._cache_sample = await asyncio.to_thread(self.engine.cache_stats)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _stuck(self, running: int, waiting: int, steps: int) -> bool:
        """Work is queued but the engine has not stepped for ``stuck_engine_s``."""
        now = time.monotonic()
        if steps != self._last_steps[0] or not (running or waiting):
            self._last_steps = (steps, now)
            return False
        return now - self._last_steps[1] > self.config.stuck_engine_s

    async def _resync(self) -> None:
        assert self.writer is not None
        if not self._policy_checked:
            await self._warn_if_redis_may_evict_the_index()
        # Events queued so far are older than the snapshot below, which covers them.
        self.buffer.discard()
        held = await asyncio.to_thread(self.engine.cached_block_hashes)
        added, removed = await self.writer.resync(held)
        self._stats_written = None  # a restarted Redis lost them too: write them again
        self._dirty = False
        self._audit_cursor = 0
        self.status.resyncs += 1
        logger.info("replica %s index resynchronised: %d blocks held (+%d, -%d)",
                    self.config.replica_id, len(held), added, removed)

    async def _warn_if_redis_may_evict_the_index(self) -> None:
        """Once: under an ``allkeys-*`` maxmemory policy Redis evicts index keys (they have no
        TTL) without telling anyone, and routers miss blocks this replica holds until the
        heartbeat's audit notices and resyncs; ``volatile-*`` policies evict only keys with a
        TTL (KV-tier entries)."""
        try:
            reply = await self.redis.config_get("maxmemory-policy")
        except ResponseError:  # CONFIG is often disabled on managed Redis: nothing to check
            reply = {}
        self._policy_checked = True
        policy = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy", b""))
        policy = policy.decode() if isinstance(policy, bytes) else str(policy)
        if policy.startswith("allkeys"):
            logger.warning("Redis at %s has maxmemory-policy %s: it may evict replica %s's cache "
                           "index, which routers then miss until a heartbeat's audit notices and "
                           "resyncs; use volatile-lru (index keys have no TTL, KV-tier entries do)",
                           self.config.redis_url, policy, self.config.replica_id)

    async def _flush(self) -> None:
        assert self.writer is not None
        if not len(self.buffer):
            return
        events = self.buffer.drain(self.config.max_events_per_flush)
        stored, removed = coalesce(events)
        try:
            await self.writer.apply(stored, removed)
        except BaseException:
            self._dirty = True  # those events are gone: only a resync restores the truth
            raise
        self.status.events_published += len(events)

    def _tier_fields(self) -> dict[str, Any]:
        facts = getattr(self.engine, "tier_facts", None)
        if facts is None:
            return {}
        name, discount = facts()
        return {"kv_tier": name, "tier_discount": None if discount is None else round(discount, 4)}

    async def _beat(self) -> None:
        running, waiting, free_pages, steps = self.engine.load_estimate()
        if self._stuck(running, waiting, steps):
            logger.error("replica %s: %d requests queued and no engine step for %.0f s; "
                         "heartbeat withheld", self.config.replica_id, running + waiting,
                         time.monotonic() - self._last_steps[1])
            return
        beat = Heartbeat(
            replica_id=self.config.replica_id,
            url=self.config.advertise_url,
            model_id=self.engine.model_id,
            served_model=self.served_model,
            page_size=self.engine.page_size,
            hash_seed=self.engine.hash_seed,
            num_running=running,
            num_waiting=waiting,
            max_waiting=self._max_waiting,
            num_pages=self._num_pages,
            pages_free=free_pages,
            auth_enabled=self.auth_enabled,
            started_at=self._started_at,
            sent_at=time.time(),
            **self._tier_fields(),
        )
        cache = self._cache_sample
        clients = self.clients() if self.clients is not None else None
        stats = snapshot_json(self.config.replica_id, cache, clients) if cache is not None else None
        stats_key = self.keys.stats_snapshot(self.config.replica_id, self._epoch)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.heartbeat(self.config.replica_id), beat.to_json(),
                 px=max(1, round(self.config.heartbeat_ttl_s * 1000)))
        pipe.sadd(self.keys.replicas, self.config.replica_id)
        # whether Redis still holds the snapshot we wrote last (and lists it for the routers)
        pipe.exists(stats_key)
        pipe.sismember(self.keys.stats_index, stats_key)
        write_stats = stats is not None and stats != self._stats_written
        if write_stats:
            queue_snapshot(pipe, self.keys, self.config.replica_id, self._epoch, stats)
        results = await pipe.execute()
        registered, snapshot_kept, snapshot_listed = results[1:4]
        if write_stats:
            self._stats_written = stats
        elif not (snapshot_kept and snapshot_listed):
            self._stats_written = None  # evicted or deleted: the next beat writes it again
        self.status.beats += 1
        if registered == 1:
            # We were not registered: a router's janitor reaped us while we looked dead.
            logger.warning("replica %s was removed from the index while away; resynchronising",
                           self.config.replica_id)
            self._dirty = True
        elif not self._dirty:
            await self._audit()

    async def _audit(self) -> None:
        """Resync when Redis lost part of our index: nothing else would ever restore it."""
        assert self.writer is not None
        self._audit_cursor, lost = await self.writer.audit(self._audit_cursor)
        if lost is None:
            return
        self.status.index_repairs += 1
        logger.warning("Redis lost part of replica %s's cache index (%s): an allkeys-* "
                       "maxmemory policy or a DEL; resynchronising", self.config.replica_id, lost)
        self._dirty = True

    def _up(self) -> None:
        if not self.status.connected:
            self.status.connected = True
            if self.status.failures:
                logger.info("Redis is reachable again; replica %s publishes its index",
                            self.config.replica_id)

    def _down(self, error: str) -> None:
        self._dirty = True
        self.buffer.discard()  # the resync after reconnecting covers these events
        self.status.failures += 1
        self.status.last_error = error
        if self.status.connected or self.status.failures == 1:
            logger.warning("Redis unreachable (%s): replica %s keeps serving; the index is "
                           "resynchronised when Redis is back", error, self.config.replica_id)
        self.status.connected = False


def publisher_from_settings(engine: Any, settings: Any, served_model: str, *,
                            clients: Callable[[], Mapping[str, int]] | None = None
                            ) -> ReplicaPublisher:
    """The publisher for a gateway's :class:`ServerSettings` (``redis_url`` must be set);
    ``clients`` as for :class:`ReplicaPublisher`.

    Raises:
        ValueError: a bad replica id or advertise URL, or port 0 without --advertise-url.
    """
    if not settings.redis_url:
        raise ValueError("publisher_from_settings needs settings.redis_url")
    config = PublisherConfig(
        redis_url=settings.redis_url,
        replica_id=settings.replica_id or default_replica_id(settings.port),
        advertise_url=settings.advertise_url or default_advertise_url(settings.host, settings.port),
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
    )
    return ReplicaPublisher(engine, config, served_model=served_model,
                            auth_enabled=settings.auth_enabled, clients=clients)
