"""The fleet's second KV tier in Redis: a page one replica evicted is loadable by every
replica (``--kv-tier redis``), so a prefix computed once serves the fleet.

Keys ``{ns}:kv:<16-byte block hash>`` hold whole entries (cache/tier.py: checksum, block hash,
parent hash, token ids, extra keys with the tenant salt, pool layout, K/V), so a loading
replica verifies everything a pool hit verifies, and two tenants never read each other's
entries (their hashes differ through the salt, and the salt is compared byte for byte).

Bounds: each replica keeps an LRU of what it wrote and deletes its oldest entries beyond
``capacity_bytes``; every key also expires after ``ttl_s`` (a replica that dies cannot leak
memory forever). Size Redis itself with ``maxmemory`` + ``allkeys-lru`` for a hard bound.

Called from the engine's tier workers (blocking client, short timeouts) and, for the cheap
"may the tier hold this block" question, from the engine thread: that one never touches the
network. It answers from local knowledge (what this replica wrote, what recent loads found
missing, whether Redis failed in the last few seconds) and otherwise says "unknown", and the
load worker finds out with its one ``MGET`` while the request waits a step. (A synchronous
``EXISTS`` with a short timeout was the first version: on a busy machine the first probe's
connect alone could time out, marking Redis down and losing the hit.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import redis
from redis.exceptions import RedisError

from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE, RedisKeys

logger = logging.getLogger("prefixgate.scaleout")

DOWN_FOR_S = 5.0  # after an error, answer "not in the tier" for this long (no stalls)
MISS_MEMORY_S = 2.0  # a probed-and-missing block is not asked again for this long
_MAX_MISSES = 65_536


class RedisTier:
    """A :class:`cache.tier.TierStore` over Redis.

    Args:
        url: ``redis://host:port/db``.
        capacity_bytes: what this replica keeps in Redis at most (its own writes).
        ttl_s: every entry expires after this long.
        timeout_s: socket timeout of the worker calls (the engine thread never calls Redis).
    """

    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float = 3600.0, timeout_s: float = 1.0):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {url!r}")
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._keys = RedisKeys(namespace)
        self.capacity_bytes = capacity_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._written: OrderedDict[bytes, int] = OrderedDict()  # block hash -> entry bytes
        self._bytes = 0
        self._misses: OrderedDict[bytes, float] = OrderedDict()  # block hash -> when probed
        self._down_until = 0.0

    def _key(self, block_hash: bytes) -> bytes:
        return self._keys.tier_entry(block_hash)

    def _failed(self, what: str) -> None:
        self._down_until = time.monotonic() + DOWN_FOR_S
        logger.warning("kv tier redis: %s failed; treating the tier as empty for %.0f s",
                       what, DOWN_FOR_S, exc_info=True)

    def put(self, key: bytes, blob: bytes) -> bool:
        if len(blob) > self.capacity_bytes:
            return False
        try:
            with self._lock:
                old = self._written.pop(key, 0)
                self._bytes += len(blob) - old
                self._written[key] = len(blob)
                doomed = []
                while self._bytes > self.capacity_bytes and len(self._written) > 1:
                    victim, size = self._written.popitem(last=False)
                    self._bytes -= size
                    doomed.append(self._key(victim))
                self._misses.pop(key, None)
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._key(key), blob, px=self.ttl_ms)
            if doomed:
                pipe.delete(*doomed)
            pipe.execute()
            return True
        except (RedisError, OSError):
            with self._lock:
                self._bytes -= self._written.pop(key, 0)
            self._failed("spill")
            raise

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if time.monotonic() < self._down_until:
            raise ConnectionError("the Redis tier is marked down")
        try:
            # which keys exist first (one small round trip), then only the leading run's
            # entries: a page is ~0.7 MB, and a chain's blocks after its first miss are useless
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            present = pipe.execute()
            run = next((i for i, found in enumerate(present) if not found), len(keys))
            blobs = self._client.mget([self._key(k) for k in keys[:run]]) if run else []
        except (RedisError, OSError):
            self._failed("load")
            raise
        if run < len(keys):
            with self._lock:
                self._remember_miss(keys[run], time.monotonic())
        return [*blobs, *([None] * (len(keys) - run))]

    def may_contain(self, key: bytes) -> bool | None:
        now = time.monotonic()
        if now < self._down_until:
            return False
        with self._lock:
            if key in self._written:
                return True
            seen = self._misses.get(key)
            if seen is not None and now - seen < MISS_MEMORY_S:
                return False
        return None  # another replica may have written it: the load worker will ask

    def _remember_miss(self, key: bytes, now: float) -> None:
        self._misses[key] = now
        self._misses.move_to_end(key)
        while len(self._misses) > _MAX_MISSES:
            self._misses.popitem(last=False)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._written.pop(key, 0)
        try:
            self._client.delete(self._key(key))
        except (RedisError, OSError):
            self._failed("discard")

    def usage(self) -> tuple[int, int, int]:
        with self._lock:
            return len(self._written), self._bytes, self.capacity_bytes
