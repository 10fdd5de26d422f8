"""Which replica holds which block: an index fed by the replicas' KV events (vLLM's ZMQ
format, gateway/scaleout/kv_events), for the Ray Serve request router.

One daemon thread owns every ZMQ socket (a socket is not thread-safe): per replica a SUB
socket on its event stream and, on joining, a DEALER on its replay socket that fetches every
kept batch from sequence 0, so a router that starts after the replica still knows what the
replica cached before. A gap in the live sequence numbers asks for a replay from the gap.
Only the pool's blocks count (medium ``GPU``): a tier hit is a load, not a pool hit.

Readers (the router, on the event loop) only look up ints in a set: no lock, no I/O.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import msgspec
import zmq

from prefixgate.gateway.scaleout.kv_events import wire

logger = logging.getLogger("prefixgate.ray_serve")

_REPLAY_TIMEOUT_MS = 2_000


@dataclass(slots=True)
class ReplicaBlocks:
    """One replica's published pool blocks and where its stream stands."""

    endpoint: str
    replay_endpoint: str | None
    held: set[int] = field(default_factory=set)
    last_seq: int = -1
    batches: int = 0
    gaps: int = 0


class BlockIndex:
    """The pool blocks of every watched replica, kept current by a background thread."""

    def __init__(self, poll_ms: int = 20):
        self.replicas: dict[str, ReplicaBlocks] = {}
        self.poll_ms = poll_ms
        self.errors = 0
        self._requests: queue.SimpleQueue[tuple[str, str, str | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, key: str, endpoint: str, replay_endpoint: str | None) -> None:
        """Follow replica ``key``'s events (idempotent; a new endpoint replaces the old)."""
        current = self.replicas.get(key)
        if current is not None and current.endpoint == endpoint:
            return
        self.replicas[key] = ReplicaBlocks(endpoint, replay_endpoint)
        self._requests.put((key, endpoint, replay_endpoint))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ray-block-index", daemon=True)
            self._thread.start()

    def forget(self, key: str) -> None:
        """Stop following ``key`` (a replica that died); its blocks no longer count."""
        self.replicas.pop(key, None)

    def matched_blocks(self, key: str, block_hashes: tuple[int, ...] | list[int]) -> int:
        """How many leading blocks of a prompt replica ``key`` holds in its pool."""
        replica = self.replicas.get(key)
        if replica is None:
            return 0
        held = replica.held
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def close(self) -> None:
        self._stop.set()
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[zmq.Socket, str] = {}
        try:
            while not self._stop.is_set():
                self._open_requested(ctx, poller, sockets)
                for sock, _ in poller.poll(self.poll_ms):
                    key = sockets[sock]
                    while sock.poll(0):
                        frames = sock.recv_multipart()
                        try:
                            self._receive(ctx, key, frames)
                        except (msgspec.DecodeError, ValueError, zmq.ZMQError) as exc:
                            self.errors += 1
                            logger.warning("KV events from %s: %s", key, exc)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _open_requested(self, ctx: zmq.Context, poller: zmq.Poller,
                        sockets: dict[zmq.Socket, str]) -> None:
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            if request is None:
                return
            key, endpoint, replay = request
            for sock, owner in list(sockets.items()):
                if owner == key:  # the replica moved: drop its old stream
                    poller.unregister(sock)
                    sock.close(linger=0)
                    del sockets[sock]
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            poller.register(sub, zmq.POLLIN)
            sockets[sub] = key
            # NOTE: SUB first, replay second: whatever is sent meanwhile arrives on the SUB
            # socket after the replayed batches and is skipped by its sequence number
            self._replay(ctx, key, 0)

    def _receive(self, ctx: zmq.Context, key: str, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        seq = int.from_bytes(frames[1], "big")
        replica = self.replicas.get(key)
        if replica is None or seq <= replica.last_seq:
            return
        if seq > replica.last_seq + 1:
            replica.gaps += 1
            self._replay(ctx, key, replica.last_seq + 1)
            if seq <= replica.last_seq:
                return
        self._apply(replica, seq, frames[2])

    def _replay(self, ctx: zmq.Context, key: str, start: int) -> None:
        """Fetch kept batches from ``start`` on (vLLM's replay protocol) and apply them."""
        replica = self.replicas.get(key)
        if replica is None or replica.replay_endpoint is None:
            return
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(replica.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(_REPLAY_TIMEOUT_MS):
                _, seq_frame, payload = dealer.recv_multipart()
                if seq_frame == wire.END_SEQ:
                    return
                seq = int.from_bytes(seq_frame, "big")
                if seq > replica.last_seq:
                    self._apply(replica, seq, payload)
            logger.warning("KV events replay from %s timed out", replica.replay_endpoint)
        finally:
            dealer.close(linger=0)

    @staticmethod
    def _apply(replica: ReplicaBlocks, seq: int, payload: bytes) -> None:
        batch = wire.decode_batch(payload)
        held = replica.held
        for event in batch.events:
            if isinstance(event, wire.AllBlocksCleared):
                held.clear()
            elif event.medium not in (None, wire.MEDIUM_GPU):
                continue
            elif isinstance(event, wire.BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)
        replica.last_seq = seq
        replica.batches += 1
