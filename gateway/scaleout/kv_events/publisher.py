"""Publish this replica's KV events in vLLM's ZMQ format, off the engine's hot path.

The cache's own event flow feeds it: the pool's BlockStored / BlockRemoved (the sink the Redis
index publisher also uses), and the second tier's stores and drops with the tier's medium.
Every sink only appends a tuple to a deque (atomic in CPython; no lock, no I/O); one daemon
thread owns both ZMQ sockets, drains the deque every few milliseconds into one ``EventBatch``,
and answers replay requests. A full queue drops events and marks the stream for a resync
(``AllBlocksCleared`` and the pool's blocks again): a subscriber's view is made right, no step
ever waits, and no request ever fails because of events.

Sequence numbers start at 0 and are contiguous over every message sent; the replay socket
(a ROUTER, vLLM's protocol) sends the kept batches from a requested sequence number on, then
``(-1, b"")``. The first batch is ``AllBlocksCleared`` and the pool's current blocks, so a
restarted replica tells its subscribers to forget what its earlier life published.

What a tenant-salted block publishes: ``salted_blocks`` in the config (docs/fleet.md).
``omit`` (the default) publishes nothing about a block whose chain carries a tenant other
than the public one (``default``, every caller's tenant when auth is off) or a ``cache_salt``:
not its hash, not its tokens, not its removal. ``publish`` publishes it like any other block,
for a subscriber trusted with every tenant's prompts (the router that tokenises them anyway).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from prefixgate.cache.events import BlockRemoved as PoolBlockRemoved
from prefixgate.cache.events import BlockStored as PoolBlockStored
from prefixgate.cache.events import CacheEvent
from prefixgate.cache.hashing import HashedBlock
from prefixgate.gateway.scaleout.kv_events import wire
from prefixgate.gateway.scaleout.kv_events.config import KVEventsConfig

logger = logging.getLogger("prefixgate.kv_events")

_RECENT_REMOVED = 65_536  # salted flags kept after removal (a block evicted, then spilled)

# queued items: ("S", medium, block) stored; ("R", medium, block hash) removed
_Item = tuple[str, str, Any]


@dataclass(slots=True)
class KVEventsStatus:
    """Counters for tests, logs and /metrics."""

    batches: int = 0  # messages sent (the next sequence number)
    stored: int = 0  # block hashes published as stored
    removed: int = 0  # block hashes published as removed
    omitted_salted: int = 0  # events not published: a salted block under salted_blocks=omit
    dropped: int = 0  # events dropped on a full queue (a resync followed)
    resyncs: int = 0  # AllBlocksCleared + snapshot sent (the first batch included)
    replays: int = 0  # replay requests answered
    errors: int = 0


def parse_extra_keys(extra_keys: bytes) -> list[str]:
    """The fields of ``cache.hashing.make_extra_keys``: model id, tenant salt, cache_salt,
    adapter id (length-prefixed, little endian)."""
    out, at = [], 0
    while at + 4 <= len(extra_keys):
        size = int.from_bytes(extra_keys[at : at + 4], "little")
        out.append(extra_keys[at + 4 : at + 4 + size].decode("utf-8", "replace"))
        at += 4 + size
    return out


class KVEventPublisher:
    """vLLM's ZMQ KV-event publisher for one replica.

    Args:
        config: the parsed ``--kv-events-config`` (must be enabled).
        topic: the topic frame (``config.topic`` or ``kv@<host>@<model>``).
        block_size: tokens per block (the engine's page size).
        snapshot: the pool's cached blocks, parents first (``AsyncEngine.cached_blocks``),
            taken for the first batch and after a full queue.
        public_tenant: blocks of this tenant without a cache_salt are not salted.
        flush_interval_s: how often the thread drains the queue (one batch per drain).
    """

    def __init__(self, config: KVEventsConfig, *, topic: str, block_size: int,
                 snapshot: Callable[[], list[HashedBlock]] | None = None,
                 public_tenant: str = "default", flush_interval_s: float = 0.005):
        if not config.enabled:
            raise ValueError("KVEventPublisher needs an enabled zmq --kv-events-config")
        self.config = config
        self.topic = topic
        self.block_size = block_size
        self.snapshot = snapshot
        self.public_tenant = public_tenant
        self.publish_salted = config.salted_blocks == "publish"
        self.flush_interval_s = flush_interval_s
        self.status = KVEventsStatus()
        self.endpoint: str | None = None  # where the PUB socket ended up (after start)
        self.replay_endpoint: str | None = None
        self._queue: deque[_Item] = deque()
        self._overflowed = True  # the first batch is a resync
        self._held: dict[str, dict[bytes, bool]] = {}  # medium -> published hash -> salted
        self._recent: OrderedDict[bytes, bool] = OrderedDict()  # removed hash -> salted
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = topic.encode()
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()  # one drain at a time (tests hold it to pause)
        self._thread: threading.Thread | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None

    # ------------------------------------------------------------------ sinks (any thread)

    def _put(self, item: _Item) -> None:
        if len(self._queue) >= self.config.max_queue_size:
            self.status.dropped += 1
            self._overflowed = True
            return
        self._queue.append(item)

    def pool_sink(self, event: CacheEvent) -> None:
        """The pool's event sink (engine thread, mid-step): append only.

        NOTE: never raises: it runs inside the pool's register/evict, where an exception
        would fail the step's requests; a failure here only costs a resync.
        """
        try:
            if isinstance(event, PoolBlockStored):
                self._put(("S", wire.MEDIUM_GPU, HashedBlock(
                    event.block_hash, event.parent_hash, event.token_bytes, event.extra_keys)))
            elif isinstance(event, PoolBlockRemoved):
                self._put(("R", wire.MEDIUM_GPU, event.block_hash))
        except Exception:  # noqa: BLE001 - see the NOTE
            self.status.errors += 1
            self._overflowed = True

    def tier_sinks(self, medium: str) -> tuple[Callable[[HashedBlock], None],
                                               Callable[[bytes], None]]:
        """(stored, removed) sinks for a second-tier store publishing as ``medium``."""
        def stored(block: HashedBlock) -> None:
            try:
                self._put(("S", medium, block))
            except Exception:  # noqa: BLE001 - as pool_sink: a spill must not fail for events
                self.status.errors += 1
                self._overflowed = True

        def removed(block_hash: bytes) -> None:
            try:
                self._put(("R", medium, block_hash))
            except Exception:  # noqa: BLE001 - as pool_sink
                self.status.errors += 1
                self._overflowed = True

        return stored, removed

    def attach(self, engine: Any) -> None:
        """Feed this publisher from ``engine``'s pool and second tier (an AsyncEngine)."""
        engine.add_event_sink(self.pool_sink)
        tier = getattr(getattr(engine, "core", None), "tier", None)
        if tier is not None:
            medium = wire.MEDIUM_BY_TIER.get(tier.store.name, tier.store.name.upper())
            stored, removed = self.tier_sinks(medium)
            tier.stored_sink = stored
            if hasattr(tier.store, "evict_sink"):
                tier.store.evict_sink = removed

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind (or connect) the sockets here, so a taken port fails at start, and start the
        thread that owns them from then on."""
        if self._thread is not None:
            return
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        endpoint = self.config.endpoint
        try:
            # vLLM's convention: a wildcard or local address binds, a host address connects
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                try:
                    replay.bind(self.config.replay_endpoint)
                except zmq.ZMQError:
                    replay.close()
                    raise
                self._replay = replay
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            pub.close()
            raise OSError(f"--kv-events-config: cannot open {endpoint}"
                          f"{' / ' + self.config.replay_endpoint if self.config.replay_endpoint else ''}"
                          f": {exc}") from exc
        self._pub = pub
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (topic %s%s)", self.endpoint, self.topic,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, stop the thread, close the sockets."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        timeout_ms = max(1, round(self.flush_interval_s * 1000))
        try:
            while True:
                stopping = self._stop.is_set()
                try:
                    if self._replay is not None:
                        if poller.poll(0 if stopping else timeout_ms):
                            self._serve_replay()
                    elif not stopping:
                        self._stop.wait(self.flush_interval_s)
                    self._flush()
                except Exception:  # a bug here must not take the replica down
                    self.status.errors += 1
                    self._overflowed = True  # whatever was lost, a resync restores the truth
                    logger.exception("KV events publisher failed; resynchronising")
                    time.sleep(0.1)
                if stopping:
                    break
        finally:
            assert self._pub is not None
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _flush(self) -> None:
        with self._flush_lock:
            self._drain()

    def _drain(self) -> None:
        events: list[Any] = []
        if self._overflowed:
            self._overflowed = False
            self._queue.clear()  # the snapshot below covers everything queued so far
            events += self._resync()
        items = []
        queue = self._queue
        while queue:
            items.append(queue.popleft())
        events += self._convert(items)
        if events:
            self._send(wire.EventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def _send(self, batch: wire.EventBatch) -> None:
        assert self._pub is not None
        payload = wire.encode_batch(batch)
        seq = self.status.batches
        self._pub.send_multipart((self._topic, wire.seq_bytes(seq), payload))
        self._buffer.append((seq, payload))
        self.status.batches = seq + 1

    def _serve_replay(self) -> None:
        """vLLM's replay: [client id, b"", start seq (8 bytes BE)] in; every kept batch with
        seq >= start as [client id, b"", seq, payload], then [client id, b"", -1, b""]."""
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring a malformed KV-events replay request (%d frames)",
                               len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", wire.seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", wire.END_SEQ, b""))
            self.status.replays += 1

    # ------------------------------------------------------------------ events

    def _resync(self) -> list[Any]:
        """AllBlocksCleared, then every pool block (its salted flag resolved through the
        chain: the snapshot lists parents first where both are cached)."""
        self.status.resyncs += 1
        self._held = {}
        events: list[Any] = [wire.AllBlocksCleared()]
        blocks = self.snapshot() if self.snapshot is not None else []
        events += self._convert([("S", wire.MEDIUM_GPU, block) for block in blocks])
        return events

    def _salted(self, block: HashedBlock) -> bool:
        """Whether ``block``'s chain carries a private salt; unknown counts as salted."""
        if block.extra_keys:  # block 0 of a chain: its own keys say
            fields = parse_extra_keys(block.extra_keys)
            tenant = fields[1] if len(fields) > 1 else ""
            cache_salt = fields[2] if len(fields) > 2 else ""
            return tenant != self.public_tenant or bool(cache_salt)
        for key in (block.parent_hash, block.block_hash):
            for held in self._held.values():
                if key in held:
                    return held[key]
            if key in self._recent:
                return self._recent[key]
        return True  # NOTE: fail closed: a block of unknown lineage is never published

    def _convert(self, items: list[_Item]) -> list[Any]:
        """Queued items as vLLM events: runs of one chain in one medium become one
        BlockStored, runs of removals in one medium one BlockRemoved."""
        events: list[Any] = []
        stored: wire.BlockStored | None = None  # the run being extended
        last_hash: bytes | None = None
        removed: wire.BlockRemoved | None = None
        for kind, medium, data in items:
            held = self._held.setdefault(medium, {})
            if kind == "S":
                block: HashedBlock = data
                salted = self._salted(block)
                held[block.block_hash] = salted
                if salted and not self.publish_salted:
                    self.status.omitted_salted += 1
                    continue
                removed = None
                tokens = array("I")
                tokens.frombytes(block.token_bytes)
                if (stored is not None and stored.medium == medium
                        and block.parent_hash == last_hash):
                    stored.block_hashes.append(wire.u64(block.block_hash))
                    stored.token_ids.extend(tokens.tolist())
                else:
                    parent = None if block.extra_keys else wire.u64(block.parent_hash)
                    stored = wire.BlockStored(
                        block_hashes=[wire.u64(block.block_hash)], parent_block_hash=parent,
                        token_ids=tokens.tolist(), block_size=self.block_size, lora_id=None,
                        medium=medium, lora_name=None)
                    events.append(stored)
                last_hash = block.block_hash
                self.status.stored += 1
            else:
                block_hash: bytes = data
                salted_or_none = held.pop(block_hash, None)
                if salted_or_none is None:
                    continue  # never published in this medium (nothing to take back)
                self._recent[block_hash] = salted_or_none
                self._recent.move_to_end(block_hash)
                while len(self._recent) > _RECENT_REMOVED:
                    self._recent.popitem(last=False)
                if salted_or_none and not self.publish_salted:
                    self.status.omitted_salted += 1
                    continue
                stored = None
                if removed is None or removed.medium != medium:
                    removed = wire.BlockRemoved(block_hashes=[], medium=medium)
                    events.append(removed)
                removed.block_hashes.append(wire.u64(block_hash))
                self.status.removed += 1
        return events


def publisher_from_settings(engine: Any, config: KVEventsConfig, model: str,
                            public_tenant: str) -> KVEventPublisher:
    """The publisher of a gateway: topic ``kv@<host>@<model>`` unless the config names one."""
    topic = config.topic or wire.default_topic(model)
    return KVEventPublisher(config, topic=topic, block_size=engine.page_size,
                            snapshot=getattr(engine, "cached_blocks", None),
                            public_tenant=public_tenant)
