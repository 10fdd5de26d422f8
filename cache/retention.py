"""Retained free pages: cached pages kept ahead of LRU eviction until a deadline (a session
waiting on a tool, an Anthropic ``cache_control`` breakpoint).

Soft, never a lock: a retained page is still free (allocatable, counted in the free pages); the
allocator takes every unretained free page first, then retained ones earliest deadline first.
An expired retention returns its page to the ordinary LRU queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from prefixgate.cache.page import Page


class RetainedPages:
    """Free cached pages ordered by retention deadline (a heap with lazy deletion).

    Shares the page's ``in_free_queue`` flag with :class:`FreePageQueue`: a free page is in
    exactly one of the two.
    """

    def __init__(self) -> None:
        self._pages: dict[int, Page] = {}
        self._heap: list[tuple[float, int, int]] = []  # (deadline, tie-break, page id)
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._pages)

    def __iter__(self) -> Iterator[Page]:
        return iter(list(self._pages.values()))

    def __contains__(self, page: Page) -> bool:
        return self._pages.get(page.page_id) is page

    def add(self, page: Page) -> None:
        assert not page.in_free_queue and page.retain_until > 0, page
        self._pages[page.page_id] = page
        page.in_free_queue = True
        heapq.heappush(self._heap, (page.retain_until, next(self._order), page.page_id))

    def remove(self, page: Page) -> None:
        del self._pages[page.page_id]
        page.in_free_queue = False  # its heap entry is skipped when it surfaces

    def _peek(self) -> Page | None:
        while self._heap:
            deadline, _, page_id = self._heap[0]
            page = self._pages.get(page_id)
            if page is not None and page.retain_until == deadline:
                return page
            heapq.heappop(self._heap)  # removed, or re-added with another deadline
        return None

    def pop_earliest(self) -> Page:
        """The page whose retention ends first (removed). Raises IndexError when empty."""
        page = self._peek()
        if page is None:
            raise IndexError("no retained page")
        self.remove(page)
        return page

    def pop_expired(self, now: float) -> Iterator[Page]:
        """Remove and yield every page whose deadline is at or before ``now``."""
        while (page := self._peek()) is not None and page.retain_until <= now:
            self.remove(page)
            yield page
