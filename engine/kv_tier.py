"""The engine's side of the second KV tier: pages out to a store when evicted, and back in
when a request's verified prefix continues into the store.

Threads. Evicted pages are copied out of the pool on the engine thread in one gather (before
this step's writes can reuse them; a memcpy per page); converting, checksumming
and writing them to the store runs on a spill worker. Loads run on a load worker (fetch,
checksum, verify, one staging tensor) while the request waits in the queue and the steps go
on; the engine thread only copies a finished load into its pages (``index_copy_``). A load
that takes longer than ``load_timeout_s`` is dropped: the request recomputes. On GPU both
directions go through pinned host memory (DMA copies; never run on a GPU yet).

Trust (invariant 8, docs/design.md): an entry is used only when its checksum holds and its block hash,
parent hash, token ids, extra keys (model, tenant salt, cache_salt) and pool layout equal the
request's (``cache.tier.verify_entry``). The first doubtful block ends the load; everything
after it is recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from prefixgate.cache.hashing import HashedBlock
from prefixgate.cache.tier import TierEntry, TierStore, decode_entry, verify_entry

logger = logging.getLogger("prefixgate.engine")

# evicted pages waiting for the spill worker at most (beyond: dropped, counted): bounds the
# memory held by gathered copies when the store is slower than eviction
MAX_SPILL_BACKLOG_PAGES = 512


class TierLoad(NamedTuple):
    """A finished load: ``payload[:, :, i]`` is the K/V of ``blocks[i]``, which continue the
    request's chain at block index ``start_block``."""

    start_block: int
    blocks: tuple[HashedBlock, ...]
    payload: Any  # torch.Tensor [L, 2, n, page_size, Hkv, D] on the host (pinned on GPU)


@dataclass(slots=True)
class TierStats:
    """Counters of the second tier (cumulative since start, except the usage fields)."""

    tier: str = ""
    entries: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    pages_spilled: int = 0
    bytes_spilled: int = 0
    spills_skipped: int = 0  # the store already held the block
    spills_dropped: int = 0  # backlog full or the store refused/failed
    probes: int = 0  # loads asked for (a request's prefix continued past the pool)
    hits: int = 0  # loads that brought at least one page
    pages_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # worker time fetching + verifying
    corrupt: int = 0  # checksum or format failures (entry discarded)
    rejected: int = 0  # intact entries for other keys/layout (collision, other tenant/model)
    late: int = 0  # loads past their deadline (recomputed)
    errors: int = 0  # the store failed (e.g. Redis down): recomputed

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def pool_layout(kv_pool: torch.Tensor) -> bytes:
    """The tag an entry must carry to be loaded into ``kv_pool`` ([L, 2, P, ps, Hkv, D])."""
    layers, _, _, page_size, heads, dim = kv_pool.shape
    return f"{kv_pool.dtype}|L{layers}|H{heads}|D{dim}|P{page_size}".encode()


def _to_host(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` as a contiguous host tensor: on GPU through pinned memory (a DMA copy, then
    this worker waits for it; the engine's stream goes on), on CPU a plain contiguous copy."""
    if not pages.is_cuda:
        return pages.contiguous()
    host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
    host.copy_(pages, non_blocking=True)
    torch.cuda.current_stream(pages.device).synchronize()
    return host


class KVTier:
    """Spills evicted pages of ``kv_pool`` to ``store`` and loads them back.

    Args:
        store: the byte store (cache.tier.HostTier, or the fleet's Redis store).
        kv_pool: the runner's pool ``[L, 2, P, page_size, Hkv, D]``.
        load_timeout_s: a load not finished by then is dropped (recompute).
    """

    def __init__(self, store: TierStore, kv_pool: torch.Tensor, *, load_timeout_s: float = 1.0):
        self.store = store
        self.kv_pool = kv_pool
        self.layout = pool_layout(kv_pool)
        self.page_shape = (kv_pool.shape[0], 2, *kv_pool.shape[3:])  # [L, 2, ps, Hkv, D]
        self.page_bytes = kv_pool[:, :, 0].numel() * kv_pool.element_size()
        self.load_timeout_s = load_timeout_s
        self._stats = TierStats(tier=store.name)
        self._lock = threading.Lock()
        self._spiller = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-spill")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        self._backlog = 0
        # NOTE: a load must see the spills of its blocks queued before it (a request returning
        # right after its pages were evicted): blocks still queued count as held by
        # may_contain, and a fetch waits (within its deadline) until none of its own is queued
        self._spill_written = threading.Condition(threading.Lock())
        self._spilling: dict[bytes, int] = {}  # block hash -> queued spills holding it
        self._loads: dict[Hashable, tuple[float, int, Future[TierLoad]]] = {}
        # set when a load finishes: an engine with nothing else to do waits on it
        self.load_done = threading.Event()
        # called on the spill worker with each block the store took (KV events publish it
        # with the store's medium: gateway/scaleout/kv_events); must not block
        self.stored_sink: Callable[[HashedBlock], None] | None = None

    # ------------------------------------------------------------------ spill (engine thread)

    def spill(self, evicted: Sequence[tuple[int, HashedBlock]]) -> None:
        """Copy the evicted pages out now (before this step writes into them) and write them to
        the store in the background."""
        todo = [(pid, block) for pid, block in evicted if self.store.may_contain(block.block_hash) is not True]
        with self._lock:
            self._stats.spills_skipped += len(evicted) - len(todo)
            room = MAX_SPILL_BACKLOG_PAGES - self._backlog
            if len(todo) > room:
                self._stats.spills_dropped += len(todo) - max(room, 0)
                todo = todo[: max(room, 0)]
            self._backlog += len(todo)
        if not todo:
            return
        index = torch.tensor([pid for pid, _ in todo], dtype=torch.int64, device=self.kv_pool.device)
        snapshot = self.kv_pool.index_select(2, index)  # [L, 2, n, ps, Hkv, D], a copy
        with self._spill_written:
            for _, block in todo:
                self._spilling[block.block_hash] = self._spilling.get(block.block_hash, 0) + 1
        self._spiller.submit(self._write, [block for _, block in todo], snapshot)

    def count_dropped(self, num_pages: int) -> None:
        """``num_pages`` evicted pages were never spilled (the caller's copy failed)."""
        with self._lock:
            self._stats.spills_dropped += num_pages

    def _write(self, blocks: list[HashedBlock], snapshot: torch.Tensor) -> None:
        written = nbytes = dropped = 0
        try:
            pages = _to_host(snapshot.permute(2, 0, 1, 3, 4, 5))  # [n, L, 2, ps, Hkv, D]
            raw = pages.view(torch.uint8).reshape(len(blocks), -1).numpy()
            for i, block in enumerate(blocks):
                blob = TierEntry(block, self.layout, raw[i].tobytes()).encode()
                try:
                    stored = self.store.put(block.block_hash, blob)
                except Exception:  # noqa: BLE001 - a dead store costs recomputes, never a crash
                    logger.warning("kv tier %s: spill failed", self.store.name, exc_info=True)
                    dropped += len(blocks) - i
                    break
                if stored:
                    written += 1
                    nbytes += len(blob)
                    if self.stored_sink is not None:
                        self.stored_sink(block)
                else:
                    dropped += 1
        finally:
            with self._spill_written:
                for block in blocks:
                    left = self._spilling.pop(block.block_hash) - 1
                    if left:
                        self._spilling[block.block_hash] = left
                self._spill_written.notify_all()
            with self._lock:
                self._backlog -= len(blocks)
                self._stats.pages_spilled += written
                self._stats.bytes_spilled += nbytes
                self._stats.spills_dropped += dropped

    # ------------------------------------------------------------------ load

    def may_contain(self, block: HashedBlock) -> bool | None:
        """Whether a load of a chain starting at ``block`` may find it (None: ask the store)."""
        if block.block_hash in self._spilling:  # a dict read: atomic under the GIL
            return True
        return self.store.may_contain(block.block_hash)

    def request(self, key: Hashable, start_block: int, blocks: Sequence[HashedBlock]) -> None:
        """Start loading ``blocks`` (a request's chain from ``start_block`` on) for ``key``."""
        self.cancel(key)
        with self._lock:
            self._stats.probes += 1
        started = time.monotonic()  # poll() drops the load past the same deadline
        future = self._loader.submit(self._fetch, start_block, tuple(blocks),
                                     started + self.load_timeout_s)
        future.add_done_callback(lambda _: self.load_done.set())
        self._loads[key] = (started, start_block, future)

    def poll(self, key: Hashable) -> TierLoad | None:
        """The finished load of ``key`` (possibly empty: recompute), or None while in flight."""
        started, start_block, future = self._loads[key]
        if not future.done():
            if time.monotonic() - started < self.load_timeout_s:
                return None
            future.cancel()
            with self._lock:
                self._stats.late += 1
            del self._loads[key]
            return TierLoad(start_block, (), None)
        del self._loads[key]
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - recompute
            logger.exception("kv tier load failed")
            return TierLoad(start_block, (), None)

    def cancel(self, key: Hashable) -> None:
        """Forget ``key``'s load (its request was aborted)."""
        held = self._loads.pop(key, None)
        if held is not None:
            held[2].cancel()

    def _fetch(self, start_block: int, blocks: tuple[HashedBlock, ...], deadline: float) -> TierLoad:
        began = time.perf_counter()
        wanted = [b.block_hash for b in blocks]
        with self._spill_written:  # a block of ours still on its way to the store: wait for it
            self._spill_written.wait_for(lambda: not any(h in self._spilling for h in wanted),
                                         timeout=max(0.0, deadline - time.monotonic()))
        try:
            blobs = self.store.get_many(wanted)
        except Exception:  # noqa: BLE001 - e.g. Redis went away: recompute, keep serving
            logger.warning("kv tier %s: load failed", self.store.name, exc_info=True)
            with self._lock:
                self._stats.errors += 1
            return TierLoad(start_block, (), None)
        good: list[bytes] = []
        corrupt = rejected = 0
        for block, blob in zip(blocks, blobs, strict=True):
            if blob is None:
                break
            entry = decode_entry(blob)
            if entry is None:
                corrupt += 1
                self.store.discard(block.block_hash)
                break
            if not verify_entry(entry, block, self.layout, self.page_bytes):
                rejected += 1
                break
            good.append(entry.payload)
        payload = None
        if good:
            cuda = self.kv_pool.is_cuda
            # on GPU the staging buffer is pinned, so the upload is a DMA, not a pageable copy
            staging = torch.empty(len(good) * self.page_bytes, dtype=torch.uint8, pin_memory=cuda)
            flat = staging.numpy()
            for i, data in enumerate(good):
                flat[i * self.page_bytes : (i + 1) * self.page_bytes] = memoryview(data)
            pages = staging.view(self.kv_pool.dtype)
            payload = pages.view(len(good), *self.page_shape).permute(1, 2, 0, 3, 4, 5)
            # NOTE: on GPU the payload stays in pinned host memory until it is written: a load
            # may be held while its request waits for room, and device memory is the pool's
        with self._lock:
            s = self._stats
            s.corrupt += corrupt
            s.rejected += rejected
            s.hits += bool(good)
            s.pages_loaded += len(good)
            s.bytes_loaded += len(good) * self.page_bytes
            s.load_seconds += time.perf_counter() - began
        return TierLoad(start_block, blocks[: len(good)], payload)

    # ------------------------------------------------------------------ engine thread

    def write(self, page_ids: Sequence[int], payload: torch.Tensor, offset: int) -> None:
        """Copy loaded blocks ``offset .. offset + len(page_ids)`` of ``payload`` into their
        pages (before any forward reads them)."""
        index = torch.tensor(list(page_ids), dtype=torch.int64, device=self.kv_pool.device)
        part = payload[:, :, offset : offset + len(page_ids)].to(self.kv_pool.device)  # DMA on GPU
        self.kv_pool.index_copy_(2, index, part)

    def load_seconds_per_token(self, page_size: int) -> float | None:
        """Worker seconds per loaded token so far (None before the first hit); lock-free read."""
        s = self._stats
        return s.load_seconds / (s.pages_loaded * page_size) if s.pages_loaded else None

    def stats(self) -> TierStats:
        entries, used, capacity = self.store.usage()
        with self._lock:
            snapshot = TierStats(**self._stats.as_dict())
        snapshot.entries, snapshot.bytes_used, snapshot.capacity_bytes = entries, used, capacity
        return snapshot

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait for queued spills (tests, shutdown)."""
        self._spiller.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        self._spiller.shutdown(wait=True, cancel_futures=False)
        self._loader.shutdown(wait=False, cancel_futures=True)
