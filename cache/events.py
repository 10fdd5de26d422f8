"""Typed events the cache emits.

Two kinds, two consumers:
  * index events (``CacheEvent``): replica-independent (no page ids), what a Redis mirror of
    the hittable set needs (gateway/scaleout);
  * statistics events (``StatsEvent``): what the counters of ``cache.stats.CacheStatsCollector``
    are fed with; the manager and the pool only emit them and keep no counters themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixgate.cache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's hash became hittable on this replica."""

    block_hash: BlockHash
    parent_hash: BlockHash
    num_tokens: int
    # what an external router needs to recompute the block (vLLM's KV events, see
    # gateway/scaleout/kv_events): its token ids (uint32 LE) and extra keys (block 0 only)
    token_bytes: bytes = field(default=b"", compare=False)
    extra_keys: bytes = field(default=b"", compare=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash is no longer hittable here (its page was reused or the cache reset)."""

    block_hash: BlockHash


CacheEvent = BlockStored | BlockRemoved
EventSink = Callable[[CacheEvent], None]


@dataclass(frozen=True, slots=True)
class PrefixQueried:
    """A new sequence looked its prompt up: a hit when ``hit_tokens`` > 0, else a miss.

    Counted in tokens (cache/stats.py). ``retention_hit_tokens``: the part of the hit served by
    pages that were free and retained when the request came.
    """

    tenant: str
    agent: str | None
    query_tokens: int
    hit_tokens: int
    retention_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PageCopied:
    """A shared or cached page was copied before a write (copy-on-write)."""

    src_page: int
    dst_page: int


class FreeList(enum.Enum):
    """Where a free page sat when allocation took it (cache/block_pool.py, in taking order)."""

    LRU = "lru"
    RETAINED = "retained"  # under retention: reused before its deadline (memory pressure)
    PROTECTED = "protected"  # held by a waiting request: reused anyway, nothing else was free


@dataclass(frozen=True, slots=True)
class PageEvicted:
    """A cached page lost its hash to be reused (lazy eviction)."""

    page_id: int
    source: FreeList


class RetentionEnd(enum.Enum):
    EXPIRED = "expired"  # its deadline passed: back to the LRU
    RECLAIMED = "reclaimed"  # ended early: a tenant below its share took the budget back


@dataclass(frozen=True, slots=True)
class RetentionEnded:
    """A page's retention ended before anything reused it."""

    page_id: int
    reason: RetentionEnd


StatsEvent = PrefixQueried | PageCopied | PageEvicted | RetentionEnded
StatsSink = Callable[[StatsEvent], None]
