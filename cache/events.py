"""Cache index events, replica-independent (no page ids): what a Redis mirror needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixgate.cache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's hash became hittable on this replica."""

    block_hash: BlockHash
    parent_hash: BlockHash
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash is no longer hittable here (its page was reused or the cache reset)."""

    block_hash: BlockHash


CacheEvent = BlockStored | BlockRemoved
EventSink = Callable[[CacheEvent], None]
