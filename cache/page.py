"""One physical page's bookkeeping record (the KV data itself lives in the runner's pool)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class Page:
    """State of physical page ``page_id``.

    ``ref_count`` = block tables holding the page (+1 while pinned). A page with
    ``ref_count == 0`` sits in the free queue; if it still has a ``block_hash`` it is
    free-but-cached: hittable until the allocator reuses it (lazy eviction).
    """

    page_id: int
    ref_count: int = 0
    pinned: bool = False
    # Set while the page is registered in the hash map. The stored token bytes, parent hash and
    # extra keys make every hit verifiable (a hash match alone is never trusted).
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_bytes: bytes | None = None
    extra_keys: bytes = b""
    # Retention (cache/retention.py): kept ahead of LRU eviction until this monotonic deadline
    # (0 = not retained); a hit extends it by ``retain_ttl`` again. ``retain_tenant`` is whose
    # budget the retention counts against (set iff ``retain_until`` is).
    retain_until: float = 0.0
    retain_ttl: float = 0.0
    retain_tenant: str | None = None
    # Free and held by a waiting request (BlockPool.hold): in the pool's protected queue, evicted
    # only after every other free page.
    protected: bool = False
    # Free-queue links (None when not queued, or at an end).
    prev: Page | None = None
    next: Page | None = None
    in_free_queue: bool = False

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else "-"
        return f"Page({self.page_id}, ref={self.ref_count}, hash={tag}{', pinned' if self.pinned else ''})"
