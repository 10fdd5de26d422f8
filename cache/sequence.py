"""Per-sequence view of the cache: its block table and how far its KV is computed."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from prefixgate.cache.hashing import HashedBlock


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """What the manager knows of one live sequence.

    Invariants (checked by ``KVCacheManager.check_integrity``):
      num_computed <= len(token_ids); len(block_table) * page_size >= num_computed;
      blocks [0, num_registered) are full, computed and (if caching is on) looked up or
      registered; hashed[i] is block i's chain hash for every full block of token_ids.
    """

    seq_id: Hashable
    token_ids: list[int]
    extra_keys: bytes
    tenant: str
    agent: str | None
    block_table: list[int] = field(default_factory=list)  # logical block -> page id, append-only
    hashed: list[HashedBlock] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is written in the pages
    num_registered: int = 0  # leading full blocks already matched or registered in the cache
    num_cached_tokens: int = 0  # prefix hit at allocation (reported as usage.cached_tokens)
