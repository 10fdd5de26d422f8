"""The router's own short memory: which replica it just sent each prefix and each session to.

The shared index only learns a prefix once its replica has computed it and published it
(prefill + a flush), which for a burst of agents with one system prompt is long after the
second agent arrives. Remembering our own recent placements closes that gap: the second agent
follows the first. Entries expire after ``ttl_s`` so a replica that never computed the prefix
(error, eviction) stops attracting it; Redis is the truth from then on.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class RecentRoutes:
    """Bounded LRU map block hash -> {replica url: expiry (monotonic seconds)}."""

    def __init__(self, ttl_s: float = 10.0, max_blocks: int = 200_000):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def record(self, chain: Sequence[bytes], url: str, now: float | None = None) -> None:
        if self.ttl_s <= 0:
            return
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        blocks = self._blocks
        for block_hash in chain:
            owners = blocks.get(block_hash)
            if owners is None:
                blocks[block_hash] = {url: expiry}
            else:
                owners[url] = expiry
                blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def matched_blocks(self, chain: Sequence[bytes], urls: Iterable[str],
                       now: float | None = None) -> dict[str, int]:
        """Leading blocks of ``chain`` recently routed to each url."""
        now = time.monotonic() if now is None else now
        out = {}
        for url in urls:
            count = 0
            for block_hash in chain:
                owners = self._blocks.get(block_hash)
                if owners is None or owners.get(url, 0.0) < now:
                    break
                count += 1
            out[url] = count
        return out

    def forget(self, url: str) -> None:
        """Drop a replica's entries (it failed: what we sent it is not cached there)."""
        for owners in self._blocks.values():
            owners.pop(url, None)

    def __len__(self) -> int:
        return len(self._blocks)


class SessionTable:
    """Bounded LRU map session id (``user`` / ``X-Agent-Id``) -> replica url it went to last."""

    def __init__(self, max_sessions: int = 100_000):
        self.max_sessions = max_sessions
        self._homes: OrderedDict[str, str] = OrderedDict()

    def home(self, session: str | None) -> str | None:
        return None if session is None else self._homes.get(session)

    def record(self, session: str | None, url: str) -> None:
        if session is None:
            return
        self._homes[session] = url
        self._homes.move_to_end(session)
        while len(self._homes) > self.max_sessions:
            self._homes.popitem(last=False)
