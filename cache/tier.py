"""The second KV tier: where evicted cached pages go instead of vanishing.

An entry is one full block's K/V (every layer, K and V) plus everything a pool hit is verified
against: its block hash, parent hash, token ids and extra keys (model, tenant salt,
cache_salt), the pool layout it was written with, and a checksum over all of it. A load is
trusted only when every one of those equals the request's (invariant 8, docs/design.md): a missing,
corrupt, foreign or late entry means the block is recomputed, never served.

Stores are byte stores keyed by block hash (pure Python, no torch): :class:`HostTier` here (a
bounded slot arena in host memory, or a memory-mapped file on local disk) and the Redis store
of the fleet (gateway/scaleout/kv_tier_redis.py). The engine side (engine/kv_tier.py)
turns pages into payload bytes and back, off the engine thread.

Entry layout (little endian)::

    magic "PGKV" | version u8 | pad 3 | layout_len u16 | extra_len u16 | token_len u32 |
    payload_len u64 | checksum u64 | block_hash 16 | parent_hash 16 |
    layout | extra_keys | token_bytes | payload

``checksum`` is xxh3_64 of every byte after it, so a torn write, a flipped bit or a truncated
value fails the check.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import xxhash

from prefixgate.cache.hashing import BlockHash, HashedBlock

MAGIC = b"PGKV"
VERSION = 1
_HEADER = struct.Struct("<4sB3xHHIQQ")  # magic, version, layout, extra, tokens, payload, checksum
_HASH_BYTES = 16
_FIXED = _HEADER.size + 2 * _HASH_BYTES
_CHECKSUM_END = _HEADER.size  # the checksum is the header's last field: it covers what follows


@dataclass(frozen=True, slots=True)
class TierEntry:
    """One block's K/V and the keys it is verified by."""

    block: HashedBlock
    layout: bytes  # the pool layout tag (dtype, layers, kv heads, head dim, page size)
    payload: bytes  # the page's K/V bytes, [L, 2, page_size, Hkv, D] row-major

    def encode(self) -> bytes:
        """The wire/storage form (the layout in this module's docstring)."""
        block = self.block
        if len(block.block_hash) != _HASH_BYTES or len(block.parent_hash) != _HASH_BYTES:
            raise ValueError("block and parent hashes must be 16 bytes")
        body = b"".join((block.block_hash, block.parent_hash, self.layout, block.extra_keys,
                         block.token_bytes))
        prefix = struct.pack("<4sB3xHHIQ", MAGIC, VERSION, len(self.layout), len(block.extra_keys),
                             len(block.token_bytes), len(self.payload))
        hasher = xxhash.xxh3_64()
        hasher.update(body)
        hasher.update(self.payload)
        return b"".join((prefix, struct.pack("<Q", hasher.intdigest()), body, self.payload))


def decode_entry(blob: bytes | memoryview) -> TierEntry | None:
    """Parse and checksum ``blob``; None when it is not an intact entry of this version."""
    if len(blob) < _FIXED:
        return None
    magic, version, layout_len, extra_len, token_len, payload_len, checksum = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        return None
    if len(blob) != _FIXED + layout_len + extra_len + token_len + payload_len:
        return None
    view = memoryview(blob)
    if xxhash.xxh3_64_intdigest(view[_CHECKSUM_END:]) != checksum:
        return None
    at = _HEADER.size
    block_hash = bytes(view[at : at + _HASH_BYTES])
    parent_hash = bytes(view[at + _HASH_BYTES : _FIXED])
    at = _FIXED
    layout = bytes(view[at : at + layout_len])
    at += layout_len
    extra_keys = bytes(view[at : at + extra_len])
    at += extra_len
    token_bytes = bytes(view[at : at + token_len])
    at += token_len
    return TierEntry(HashedBlock(block_hash, parent_hash, token_bytes, extra_keys), layout,
                     bytes(view[at:]))


def verify_entry(entry: TierEntry | None, expected: HashedBlock, layout: bytes,
                 payload_bytes: int) -> bool:
    """Whether ``entry`` may be served for ``expected`` (invariant 8): the same hash, parent,
    token ids and extra keys (tenant salt), this pool's layout, a payload of a page's size."""
    return (
        entry is not None
        and entry.block == expected
        and entry.layout == layout
        and len(entry.payload) == payload_bytes
    )


class TierStore(Protocol):
    """A bounded byte store keyed by block hash. Thread-safe: the engine's tier worker writes
    and reads it while the engine thread asks :meth:`may_contain`."""

    name: str

    def put(self, key: BlockHash, blob: bytes) -> bool:
        """Store ``blob`` (evicting older entries if full); False when it cannot be stored."""
        ...

    def get_many(self, keys: list[BlockHash]) -> list[bytes | None]:
        """The blobs of ``keys`` in order (None where missing). Raises OSError-like errors on
        a dead backend; the caller recomputes."""
        ...

    def may_contain(self, key: BlockHash) -> bool | None:
        """Cheap local answer: True/False when known, None when only a round trip can tell."""
        ...

    def discard(self, key: BlockHash) -> None:
        """Drop ``key`` (a corrupt or unverifiable entry)."""
        ...

    def usage(self) -> tuple[int, int, int]:
        """(entries, bytes used, capacity in bytes)."""
        ...


class HostTier:
    """A bounded store of fixed-size slots in host memory (anonymous mmap) or in a
    memory-mapped file on local disk (``path``), evicting least recently used entries.

    Slots have one size (a page's entry plus room for its keys), so the arena never
    fragments and its bound is exact; a file-backed arena lets the OS page it to disk.

    Args:
        capacity_bytes: the arena's size; at least one slot.
        slot_bytes: the largest entry stored (larger ones are refused).
        path: back the arena by this file (created or truncated to the capacity).
    """

    name = "host"

    def __init__(self, capacity_bytes: int, slot_bytes: int, *, path: str | Path | None = None):
        if slot_bytes < 1 or capacity_bytes < slot_bytes:
            raise ValueError(f"a tier of {capacity_bytes} bytes cannot hold one {slot_bytes}-byte entry")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        size = self.num_slots * slot_bytes
        self._file = None
        if path is not None:
            self.name = "disk"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._arena = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        else:
            self._arena = mmap.mmap(-1, size)
        self._lock = threading.Lock()
        self._slots: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # key -> (slot, length)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.num_evicted = 0
        self._bytes = 0
        # called with a block hash the store dropped (LRU eviction, discard): KV events
        # publish it as removed from this medium (gateway/scaleout/kv_events)
        self.evict_sink: Callable[[BlockHash], None] | None = None

    def put(self, key: BlockHash, blob: bytes) -> bool:
        if len(blob) > self.slot_bytes:
            return False
        with self._lock:
            held = self._slots.get(key)
            if held is not None:
                self._slots.move_to_end(key)
                if held[1] == len(blob):
                    return True  # the same block again (its content is fixed by its hash)
                slot = held[0]
                self._bytes -= held[1]
            elif self._free:
                slot = self._free.pop()
            else:
                victim, (slot, length) = self._slots.popitem(last=False)
                self._bytes -= length
                self.num_evicted += 1
                if self.evict_sink is not None:
                    self.evict_sink(victim)
            start = slot * self.slot_bytes
            self._arena[start : start + len(blob)] = blob
            self._slots[key] = (slot, len(blob))
            self._bytes += len(blob)
            return True

    def get_many(self, keys: list[BlockHash]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                held = self._slots.get(key)
                if held is None:
                    out.append(None)
                    continue
                self._slots.move_to_end(key)
                start = held[0] * self.slot_bytes
                out.append(self._arena[start : start + held[1]])
        return out

    def may_contain(self, key: BlockHash) -> bool:
        return key in self._slots  # a dict read: atomic under the GIL, no lock needed

    def discard(self, key: BlockHash) -> None:
        with self._lock:
            held = self._slots.pop(key, None)
            if held is not None:
                self._free.append(held[0])
                self._bytes -= held[1]
                if self.evict_sink is not None:
                    self.evict_sink(key)

    def usage(self) -> tuple[int, int, int]:
        return len(self._slots), self._bytes, self.num_slots * self.slot_bytes

    def close(self) -> None:
        with self._lock:
            self._arena.close()


def entry_slot_bytes(payload_bytes: int, max_keys_bytes: int = 4096) -> int:
    """A slot size that holds one page's entry with up to ``max_keys_bytes`` of layout, extra
    keys and token ids."""
    return _FIXED + payload_bytes + max_keys_bytes
