import pytest

from prefixgate.cache.free_queue import FreePageQueue
from prefixgate.cache.page import Page


def ids(queue):
    return [p.page_id for p in queue]


def test_order_and_middle_removal():
    pages = [Page(i) for i in range(5)]
    q = FreePageQueue(pages)
    assert ids(q) == [0, 1, 2, 3, 4]
    q.remove(pages[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    q.remove(pages[0])
    q.remove(pages[4])
    assert ids(q) == [1, 3]
    q.append(pages[0])
    q.appendleft(pages[4])
    assert ids(q) == [4, 1, 3, 0]
    assert q.popleft() is pages[4]
    assert ids(q) == [1, 3, 0]


def test_misuse_is_loud():
    q = FreePageQueue()
    with pytest.raises(IndexError):
        q.popleft()
    p = Page(0)
    q.append(p)
    with pytest.raises(AssertionError):
        q.append(p)
    q.remove(p)
    with pytest.raises(AssertionError):
        q.remove(p)
