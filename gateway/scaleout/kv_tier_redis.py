"""The fleet's second KV tier in Redis: a page one replica evicted is loadable by every
replica (``--kv-tier redis``), so a prefix computed once serves the fleet.

Keys ``{ns}:kv:<16-byte block hash>`` hold whole entries (cache/tier.py: checksum, block hash,
parent hash, token ids, extra keys with the tenant salt, pool layout, K/V), so a loading
replica verifies everything a pool hit verifies, and two tenants never read each other's
entries (their hashes differ through the salt, and the salt is compared byte for byte).

Authenticated: anyone who can write to the fleet's Redis could otherwise plant K/V in any
tenant's prefix (the entry checksum is keyless and the tenant salt sits in the entry). Every
value is a keyed BLAKE2b MAC under the fleet secret (``--kv-tier-secret``, the same on every
replica) over the Redis key and the entry, then the entry; a value whose MAC does not verify is
handed on as corrupt (never decoded), counted and deleted.

Bounds: each replica keeps an LRU of what it wrote and deletes its oldest entries beyond
``capacity_bytes``; every key also expires after ``ttl_s`` (a replica that dies cannot leak
memory forever). Size Redis itself with ``maxmemory`` + ``volatile-lru`` for a hard bound
(``allkeys-lru`` would evict the cache index too: it has no TTL, entries do).

Redis drops entries behind the replica's back (the TTL, maxmemory eviction), so "I wrote it" is
trusted only for ``confirm_s`` after Redis last confirmed the entry; after that a spill of the
block asks Redis (``PEXPIRE``: present entries get a fresh TTL, which also keeps a block the
fleet keeps evicting alive) and writes it again when it is gone.

Called from the engine's tier workers (blocking client, short timeouts) and, for the cheap
"may the tier hold this block" question, from the engine thread: that one never touches the
network. It answers from local knowledge (what this replica wrote, what recent loads found
missing, whether Redis failed in the last few seconds) and otherwise says "unknown", and the
load worker finds out with its one ``MGET`` while the request waits a step. (A synchronous
``EXISTS`` with a short timeout was the first version: on a busy machine the first probe's
connect alone could time out, marking Redis down and losing the hit.)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import redis
from redis.exceptions import RedisError

from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE, RedisKeys

logger = logging.getLogger("prefixgate.scaleout")

DOWN_FOR_S = 5.0  # after an error, answer "not in the tier" for this long (no stalls)
MISS_MEMORY_S = 2.0  # a probed-and-missing block is not asked again for this long
_MAX_MISSES = 65_536
MAC_BYTES = 32
CONFIRM_S = 10.0  # trust "this replica wrote it" this long after Redis last confirmed it
MIN_SECRET_CHARS = 16


def mac_key(secret: str) -> bytes:
    """The MAC key of a fleet secret (any length in, BLAKE2b's 64-byte key limit out)."""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the kv tier secret must have at least {MIN_SECRET_CHARS} characters")
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"prefixgate-kv").digest()


def entry_mac(key: bytes, redis_key: bytes, blob: bytes | memoryview) -> bytes:
    """The MAC of one value: it binds the entry to its key, so entries cannot be swapped."""
    hasher = hashlib.blake2b(key=key, digest_size=MAC_BYTES)
    hasher.update(len(redis_key).to_bytes(4, "little"))
    hasher.update(redis_key)
    hasher.update(blob)
    return hasher.digest()


class RedisTier:
    """A :class:`cache.tier.TierStore` over Redis.

    Args:
        url: ``redis://host:port/db``.
        capacity_bytes: what this replica keeps in Redis at most (its own writes).
        secret: the fleet secret entries are authenticated with (the same on every replica).
        ttl_s: every entry expires after this long.
        timeout_s: socket timeout of the worker calls (the engine thread never calls Redis).
        confirm_s: how long a write (or a load that found the entry) is trusted without asking.
    """

    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, *, secret: str,
                 namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 3600.0,
                 timeout_s: float = 1.0, confirm_s: float = CONFIRM_S):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {url!r}")
        self._mac_key = mac_key(secret)
        self.confirm_s = min(confirm_s, ttl_s / 4)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._keys = RedisKeys(namespace)
        self.capacity_bytes = capacity_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        # block hash -> (entry bytes, when Redis last confirmed it held the entry)
        self._written: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._bytes = 0
        self._misses: OrderedDict[bytes, float] = OrderedDict()  # block hash -> when probed
        self._down_until = 0.0
        # called with a block hash this replica deleted or found gone (KV events publish it
        # as removed from Redis: gateway/scaleout/kv_events); TTL expiry unnoticed is not seen
        self.evict_sink: Callable[[bytes], None] | None = None

    def _key(self, block_hash: bytes) -> bytes:
        return self._keys.tier_entry(block_hash)

    def _failed(self, what: str) -> None:
        self._down_until = time.monotonic() + DOWN_FOR_S
        logger.warning("kv tier redis: %s failed; treating the tier as empty for %.0f s",
                       what, DOWN_FOR_S, exc_info=True)

    def put(self, key: bytes, blob: bytes) -> bool:
        if len(blob) + MAC_BYTES > self.capacity_bytes:
            return False
        redis_key = self._key(key)
        try:
            if key in self._written and self._client.pexpire(redis_key, self.ttl_ms):
                # still there (and its TTL renewed): nothing to write
                self._confirm(key, len(blob) + MAC_BYTES)
                return True
            doomed = self._account(key, len(blob) + MAC_BYTES)
            pipe = self._client.pipeline(transaction=False)
            pipe.set(redis_key, entry_mac(self._mac_key, redis_key, blob) + blob, px=self.ttl_ms)
            if doomed:
                pipe.delete(*doomed)
            pipe.execute()
            return True
        except (RedisError, OSError):
            self._forget(key)
            self._failed("spill")
            raise

    def _account(self, key: bytes, size: int) -> list[bytes]:
        """Record ``key`` as written; the Redis keys of our oldest entries beyond capacity."""
        doomed = []
        with self._lock:
            self._confirm_locked(key, size)
            while self._bytes > self.capacity_bytes and len(self._written) > 1:
                victim, (victim_size, _) = self._written.popitem(last=False)
                self._bytes -= victim_size
                doomed.append(self._key(victim))
                if self.evict_sink is not None:
                    self.evict_sink(victim)
            self._misses.pop(key, None)
        return doomed

    def _confirm(self, key: bytes, size: int) -> None:
        with self._lock:
            self._confirm_locked(key, size)

    def _confirm_locked(self, key: bytes, size: int) -> None:
        old, _ = self._written.pop(key, (0, 0.0))
        self._bytes += size - old
        self._written[key] = (size, time.monotonic())

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._written.pop(key, (0, 0.0))[0]

    def _authentic(self, key: bytes, value: bytes | None) -> bytes | None:
        """The entry inside ``value`` if its MAC verifies; b"" (corrupt) if not."""
        if value is None:
            return None
        redis_key = self._key(key)
        view = memoryview(value)
        if len(value) < MAC_BYTES or not hmac.compare_digest(
                entry_mac(self._mac_key, redis_key, view[MAC_BYTES:]), bytes(view[:MAC_BYTES])):
            logger.warning("kv tier redis: an entry failed authentication (a foreign or forged "
                           "value, or a replica with another --kv-tier-secret)")
            return b""
        return value[MAC_BYTES:]

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
        now = time.monotonic()
        with self._lock:
            for key in keys[:run]:
                if key in self._written:
                    self._written[key] = (self._written[key][0], now)
            if run < len(keys):
                self._remember_miss(keys[run], now)
                # Redis dropped it (TTL, maxmemory eviction): ours no longer, spill it again
                self._bytes -= self._written.pop(keys[run], (0, 0.0))[0]
                if self.evict_sink is not None:
                    self.evict_sink(keys[run])
        return [*(self._authentic(k, b) for k, b in zip(keys, blobs, strict=False)),
                *([None] * (len(keys) - run))]

    def may_contain(self, key: bytes) -> bool | None:
        now = time.monotonic()
        if now < self._down_until:
            return False
        with self._lock:
            written = self._written.get(key)
            if written is not None and now - written[1] < self.confirm_s:
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
        self._forget(key)
        if self.evict_sink is not None:
            self.evict_sink(key)
        try:
            self._client.delete(self._key(key))
        except (RedisError, OSError):
            self._failed("discard")

    def usage(self) -> tuple[int, int, int]:
        with self._lock:
            return len(self._written), self._bytes, self.capacity_bytes
