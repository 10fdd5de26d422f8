"""Doubly-linked free queue with O(1) removal from the middle.

Front = evicted first. Free-but-cached pages are appended at the back (LRU: the longer a page
has been free, the sooner it is reused); pages with no hash go to the front because nobody can
ever hit them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prefixgate.cache.page import Page


class FreePageQueue:
    def __init__(self, pages: list[Page] | None = None):
        self._head: Page | None = None
        self._tail: Page | None = None
        self._len = 0
        for page in pages or ():
            self.append(page)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        node = self._head
        while node is not None:
            yield node
            node = node.next

    def append(self, page: Page) -> None:
        """Put ``page`` at the back (reused last)."""
        assert not page.in_free_queue, f"{page} is already in the free queue"
        page.prev, page.next = self._tail, None
        if self._tail is None:
            self._head = page
        else:
            self._tail.next = page
        self._tail = page
        page.in_free_queue = True
        self._len += 1

    def appendleft(self, page: Page) -> None:
        """Put ``page`` at the front (reused first)."""
        assert not page.in_free_queue, f"{page} is already in the free queue"
        page.prev, page.next = None, self._head
        if self._head is None:
            self._tail = page
        else:
            self._head.prev = page
        self._head = page
        page.in_free_queue = True
        self._len += 1

    def popleft(self) -> Page:
        if self._head is None:
            raise IndexError("pop from an empty free queue")
        page = self._head
        self.remove(page)
        return page

    def remove(self, page: Page) -> None:
        """Unlink ``page`` from wherever it is, in O(1)."""
        assert page.in_free_queue, f"{page} is not in the free queue"
        if page.prev is None:
            self._head = page.next
        else:
            page.prev.next = page.next
        if page.next is None:
            self._tail = page.prev
        else:
            page.next.prev = page.prev
        page.prev = page.next = None
        page.in_free_queue = False
        self._len -= 1
