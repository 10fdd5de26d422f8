"""The KV-events publisher's counters on ``/metrics`` (``prefixgate:kv_events_*``): what was
published, what a salted block kept private, what a full queue dropped, how often the stream
was resynchronised, so a fleet operator sees a subscriber's view drifting before a router does.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixgate.gateway.scaleout.kv_events.publisher import KVEventsStatus

PREFIX = "prefixgate:kv_events_"

# (name, help, KVEventsStatus field)
_COUNTERS = (
    ("batches", "KV-event messages published (EventBatch; the next sequence number).", "batches"),
    ("stored_blocks", "Block hashes published as stored (every medium).", "stored"),
    ("removed_blocks", "Block hashes published as removed (every medium).", "removed"),
    ("omitted_salted", "Events not published: a tenant-salted block under "
     "salted_blocks=omit.", "omitted_salted"),
    ("dropped", "Events dropped on a full queue (max_queue_size); a resync followed.",
     "dropped"),
    ("resyncs", "AllBlocksCleared + snapshot batches sent (the first batch included).",
     "resyncs"),
    ("replays", "Replay requests answered on the replay socket.", "replays"),
    ("errors", "Publisher failures (each followed by a resync).", "errors"),
)


class KVEventsCollector(Collector):
    """Reads a publisher's ``KVEventsStatus`` at each scrape."""

    def __init__(self, status: KVEventsStatus, model_name: str):
        self.status = status
        self.model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        for name, help_text, field in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], getattr(self.status, field))
            yield family
