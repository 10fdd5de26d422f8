"""``--kv-events-config``: vLLM's KV-events JSON, so an existing manifest works unchanged.

vLLM's fields (``vllm/config/kv_events.py``): ``enable_kv_cache_events``, ``publisher``
(``"zmq"`` or ``"null"``), ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``. One of ours: ``salted_blocks`` (``"omit"`` or ``"publish"``),
what a tenant-salted block publishes (docs/fleet.md, "What a salted block publishes").
Unknown fields are an error (a typo must not silently turn events off).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SALTED_BLOCKS = ("omit", "publish")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """KV events in vLLM's ZMQ format (gateway/scaleout/kv_events/publisher.py).

    ``topic`` empty means ``kv@<host>@<model>`` (what llm-d's subscriber parses).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread; beyond: resync
    topic: str = ""
    salted_blocks: str = "omit"

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", "
                             f"got {self.publisher!r}")
        if self.salted_blocks not in SALTED_BLOCKS:
            raise ValueError(f"--kv-events-config: salted_blocks must be one of "
                             f"{', '.join(SALTED_BLOCKS)}, got {self.salted_blocks!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {name} must be a ZMQ address "
                                 f"(tcp://, ipc:// or inproc://), got {value!r}")

    @property
    def enabled(self) -> bool:
        """Events are published (vLLM: enabled and a publisher other than ``null``)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS = {f.name for f in fields(KVEventsConfig)}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse the JSON of ``--kv-events-config`` (vLLM's defaults fill what it omits; as in
    vLLM, ``publisher`` defaults to ``zmq`` when events are enabled).

    Raises:
        ValueError: not a JSON object, an unknown field, or a bad value.
    """
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(_FIELDS))})")
    if raw.get("publisher") is None:
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
    _check_types(raw)
    return KVEventsConfig(**raw)


def _check_types(raw: dict[str, Any]) -> None:
    expected = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int,
                "max_queue_size": int}
    for name, kind in expected.items():
        value = raw.get(name)
        if value is not None and (type(value) is not kind):
            raise ValueError(f"--kv-events-config: {name} must be a JSON "
                             f"{'boolean' if kind is bool else 'integer'}, got {value!r}")
    for name in ("publisher", "endpoint", "topic", "salted_blocks"):
        if name in raw and not isinstance(raw[name], str):
            raise ValueError(f"--kv-events-config: {name} must be a string")
    if raw.get("replay_endpoint") is not None and not isinstance(raw["replay_endpoint"], str):
        raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
