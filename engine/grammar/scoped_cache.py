"""A least-recently-used cache bounded in bytes, with a share per scope (tenant).

Compiled grammars and schema conversions are cached so that a swarm repeating its schemas
compiles each once. A flood of distinct schemas must not turn that cache into unbounded memory,
and one tenant's flood must not push every other tenant's grammars out: each scope may hold at
most ``scope_bytes``, and the whole cache at most ``max_bytes``. An entry larger than a scope's
share is served but not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ScopedLRUCache(Generic[V]):
    """Thread-safe LRU of ``(scope, key) → value``, bounded in bytes overall and per scope.

    Args:
        max_bytes: the whole cache's byte budget.
        scope_share: the largest fraction of ``max_bytes`` one scope may hold.
    """

    def __init__(self, max_bytes: int, scope_share: float = 0.5) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.scope_bytes = int(self.max_bytes * min(1.0, max(0.0, scope_share)))
        self._entries: OrderedDict[tuple[str, Hashable], tuple[V, int]] = OrderedDict()
        self._bytes_by_scope: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """Bytes held now (the sum of the sizes given to :meth:`put`)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def scope_num_bytes(self, scope: str) -> int:
        """Bytes ``scope`` holds now."""
        return self._bytes_by_scope.get(scope, 0)

    def get(self, scope: str, key: Hashable) -> V | None:
        """The cached value (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get((scope, key))
            if entry is None:
                return None
            self._entries.move_to_end((scope, key))
            return entry[0]

    def put(self, scope: str, key: Hashable, value: V, size: int) -> None:
        """Keep ``value`` (``size`` bytes), evicting ``scope``'s own oldest entries first while
        it is over its share, then the oldest of any scope while the cache is over budget."""
        size = max(1, int(size))
        if size > self.scope_bytes:
            return
        with self._lock:
            self._drop((scope, key))
            self._entries[(scope, key)] = (value, size)
            self._bytes += size
            self._bytes_by_scope[scope] = self._bytes_by_scope.get(scope, 0) + size
            if self._bytes_by_scope[scope] > self.scope_bytes:
                for entry_key in [k for k in self._entries if k[0] == scope]:
                    if self._bytes_by_scope[scope] <= self.scope_bytes:
                        break
                    self._drop(entry_key)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes_by_scope.clear()
            self._bytes = 0

    def _drop(self, key: tuple[str, Hashable]) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._bytes -= entry[1]
        left = self._bytes_by_scope[key[0]] - entry[1]
        if left:
            self._bytes_by_scope[key[0]] = left
        else:
            del self._bytes_by_scope[key[0]]
