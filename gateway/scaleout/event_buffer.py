"""The engine-side end of index publication: a bounded, lock-free queue of cache events.

The cache calls the sink from the engine thread in the middle of a step, once per stored or
removed block: it must only append (no Redis, no lock, no allocation beyond the deque cell).
The publisher drains it from the event loop. A deque's append/popleft are atomic in CPython.
"""

from __future__ import annotations

from collections import deque

from prefixgate.cache.events import CacheEvent


class EventBuffer:
    """Callable event sink that never blocks.

    Args:
        max_events: beyond this many undrained events new ones are dropped and
            ``overflowed`` is set: the publisher then resynchronises the whole index instead.
    """

    def __init__(self, max_events: int = 1_000_000):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self._events: deque[CacheEvent] = deque()
        self.overflowed = False

    def __call__(self, event: CacheEvent) -> None:
        if len(self._events) >= self.max_events:
            self.overflowed = True
            return
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self, limit: int) -> list[CacheEvent]:
        """Take up to ``limit`` events, oldest first."""
        out: list[CacheEvent] = []
        events = self._events
        while events and len(out) < limit:
            out.append(events.popleft())
        return out

    def discard(self) -> None:
        """Drop everything queued (a resync snapshot taken after this covers it)."""
        self.overflowed = False
        self._events.clear()

    def close(self) -> None:
        """Stop accepting events for good (the publisher stopped; the sink stays attached)."""
        self.max_events = 0
        self.discard()
