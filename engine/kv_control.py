"""The KV manager's door for everything besides the scheduler's own steps.

Only the scheduler's KV manager touches ``cache/`` (docs/design.md, tests/test_layers.py): the
scheduler allocates, writes, commits, forks and frees in its steps; the connector
(kv_connector.py) moves pages to and from the second tier; and this object serves the engine
and the gateway: pins, retention, stats, KV events, reset, recovery after a failed step.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

from prefixgate.cache import HashedBlock, KVCacheManager
from prefixgate.cache.events import CacheEvent, EventSink
from prefixgate.cache.stats import CacheStats
from prefixgate.engine.kv_connector import KVConnector, TierLoader

logger = logging.getLogger("prefixgate.engine")


class KVControl:
    """Cache operations for the engine and the gateway, over the scheduler's KV manager.

    Args:
        cache: the scheduler's KV manager.
    """

    def __init__(self, cache: KVCacheManager) -> None:
        self._cache = cache

    @property
    def num_pages(self) -> int:
        return self._cache.num_pages

    @property
    def page_size(self) -> int:
        return self._cache.page_size

    @property
    def num_free_pages(self) -> int:
        """Read without the engine lock by load reports (exact at some recent instant)."""
        return self._cache.num_free_pages

    @property
    def has_state_group(self) -> bool:
        """Whether a hybrid model's recurrent-state group is part of the cache."""
        return self._cache.state is not None

    def connector(self, tier: TierLoader, state_tier: Any = None) -> KVConnector:
        """A connector of this cache to a second tier (and a hybrid's checkpoint tier)."""
        return KVConnector(self._cache, tier, state_tier)

    # ------------------------------------------------------------------ pins and retention

    def pin(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        """Pin the cached full blocks of ``token_ids``; returns pages pinned."""
        return self._cache.pin(token_ids, extra_keys)

    def unpin(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        """Unpin the cached full blocks of ``token_ids``; returns how many were pinned."""
        return self._cache.unpin(token_ids, extra_keys)

    def num_pinned_prefix_pages(self, token_ids: Sequence[int], extra_keys: bytes) -> int:
        return self._cache.num_pinned_prefix_pages(token_ids, extra_keys)

    def retain(self, token_ids: Sequence[int], extra_keys: bytes, ttl_s: float, *,
               max_pages: int, tenant: str, max_tenant_pages: int) -> int:
        """Keep the cached full blocks of ``token_ids`` ahead of LRU eviction for ``ttl_s``
        (``KVCacheManager.retain``); returns pages retained."""
        return self._cache.retain(token_ids, extra_keys, ttl_s, max_pages=max_pages,
                                  tenant=tenant, max_tenant_pages=max_tenant_pages)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State slot copies the runner must make now (a hybrid's forks)."""
        return self._cache.take_state_copies()

    # ------------------------------------------------------------------ stats and events

    def stats(self) -> CacheStats:
        return self._cache.stats()

    def reset(self) -> int:
        """Drop every unreferenced cached page's hash; returns how many."""
        return self._cache.reset_cache()

    def add_event_sink(self, sink: EventSink) -> None:
        """Also send BlockStored / BlockRemoved to ``sink`` (from the engine thread)."""
        pool = self._cache.pool
        previous = pool.event_sink
        pool.event_sink = sink if previous is None else _fan_out(previous, sink)

    def cached_hashes(self) -> list[bytes]:
        """Every block hash hittable right now."""
        return self._cache.pool.cached_hashes()

    def cached_blocks(self) -> list[HashedBlock]:
        """Every hittable block with its parent, token ids and extra keys."""
        return [HashedBlock(h, p.parent_hash, p.token_bytes or b"", p.extra_keys)
                for h, p in self._cache.pool.cached.items() if p.parent_hash is not None]

    # ------------------------------------------------------------------ recovery

    def forget_unwritten(self) -> set[Hashable]:
        """Un-cache the pages of tier loads a failed step never wrote."""
        return self._cache.tier_pages.forget_unwritten()

    def release_everything(self) -> None:
        """After a failed step, every request failed: free what only the manager still knows
        (a step that raised between the manager's allocate and the scheduler's bookkeeping
        leaves such a sequence), drop the holds, check the invariants; a cache that fails them
        drops its unreferenced hashes (nothing doubtful is served; pinned pages stay)."""
        for seq_id in self._cache.sequence_ids():
            self._cache.free(seq_id)
        self._cache.release_all_holds()
        try:
            self._cache.check_integrity()
        except Exception:
            logger.exception("the KV cache failed its integrity check after a failed step; "
                             "dropping its cached hashes")
            self._cache.reset_cache()
            self._cache.check_integrity()


def _fan_out(first: EventSink, second: EventSink) -> EventSink:
    def sink(event: CacheEvent) -> None:
        first(event)
        second(event)

    return sink
