"""Paged KV cache core: chained block hashing, refcounted pages, LRU reuse, copy-on-write.

Pure Python (xxhash + stdlib). Knows nothing of torch, HTTP or Redis.
"""

from prefixgate.cache.block_pool import BlockPool
from prefixgate.cache.errors import (
    CacheError,
    DuplicateSequenceError,
    IntegrityError,
    InvalidArgumentError,
    OutOfPagesError,
    UnknownSequenceError,
)
from prefixgate.cache.events import BlockRemoved, BlockStored, CacheEvent, EventSink
from prefixgate.cache.hashing import BlockHasher, HashedBlock, make_extra_keys, xxh3_128_hash_fn
from prefixgate.cache.manager import Allocation, KVCacheManager, PrefixMatch
from prefixgate.cache.sequence import CacheSequence, TokenSequence
from prefixgate.cache.state_slots import StateOps, StateSlots
from prefixgate.cache.stats import CacheStats, HitStats, SharedPrefix

__all__ = [
    "StateOps",
    "StateSlots",
    "Allocation",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheError",
    "CacheEvent",
    "CacheSequence",
    "CacheStats",
    "DuplicateSequenceError",
    "EventSink",
    "HashedBlock",
    "HitStats",
    "IntegrityError",
    "InvalidArgumentError",
    "KVCacheManager",
    "OutOfPagesError",
    "PrefixMatch",
    "SharedPrefix",
    "TokenSequence",
    "UnknownSequenceError",
    "make_extra_keys",
    "xxh3_128_hash_fn",
]
