"""Prometheus text shared by the replica's and the router's ``/metrics``: the exposition
content type, and bounded label values for unbounded keys (tenants, agents)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prefixgate.cache.stats import HitStats

OTHER_LABEL = "__other__"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StickyLabeler:
    """Maps an unbounded set of keys onto at most ``max_labels`` label values plus ``__other__``."""

    def __init__(self, max_labels: int):
        self.max_labels = max_labels
        self._labelled: set[str] = set()
        self._overflow: set[str] = set()

    def admit(self, keys_busiest_first: Iterable[str]) -> None:
        for key in keys_busiest_first:
            if key in self._labelled or key in self._overflow:
                continue
            if len(self._labelled) < self.max_labels and key != OTHER_LABEL:
                self._labelled.add(key)
            else:
                self._overflow.add(key)

    def label(self, key: str) -> str:
        return key if key in self._labelled else OTHER_LABEL

    def fold(self, per_key: Mapping[str, HitStats]) -> dict[str, tuple[int, int]]:
        """``{key: stats}`` → ``{label: (query_tokens, hit_tokens)}`` with overflow summed."""
        self.admit(sorted(per_key, key=lambda k: -per_key[k].query_tokens))
        folded: dict[str, tuple[int, int]] = {}
        for key, stats in per_key.items():
            label = self.label(key)
            queries, hits = folded.get(label, (0, 0))
            folded[label] = (queries + stats.query_tokens, hits + stats.hit_tokens)
        return folded
