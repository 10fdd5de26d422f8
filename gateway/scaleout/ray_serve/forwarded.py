"""What the ingress hands a replica: the HTTP request as received, plus its block hashes.

The request router reads ``block_hashes`` (ours) or ``messages`` (the attribute Ray's
``PrefixCacheAffinityRouter`` reads: it matches characters of the messages' contents), so the
same record serves every router the benchmark compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request on its way to a replica (pickled into the replica's actor call).

    ``block_hashes`` are the u64 hashes the replicas publish in their KV events (our chained
    block keys cut to 64 bits, ``kv_events.wire.u64``), one per full block of the prompt; empty
    for a request without a prompt (``/v1/models``) or one the ingress could not parse (the
    replica answers it with its own 4xx).
    """

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    block_hashes: tuple[int, ...] = ()
    num_tokens: int = 0
    messages: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The first item a replica's stream yields: status and headers; body chunks follow."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str  # the Ray replica id that served it


def message_texts(method: str, path: str, body: bytes) -> list[Any]:
    """A request's text as a list of ``{"content": ...}`` items (Ray's router concatenates
    their contents): the system prompt first, then the messages or the prompt.

    NOTE: never empty: Ray's ``PrefixCacheAffinityRouter`` divides by the text's length (an
    empty one kills its routing loop: ZeroDivisionError, the request hangs), so a request
    without a prompt (``GET /v1/models``, a body that is not JSON) is its method and path.
    """
    fallback = [{"content": f"{method} {path}"}]
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return fallback
    if not isinstance(data, dict):
        return fallback
    items: list[Any] = []
    system = data.get("system") or data.get("instructions")  # Anthropic / Responses
    if system:
        items.append({"content": system})
    for key in ("messages", "input", "prompt"):
        value = data.get(key)
        if isinstance(value, list):
            items += [v if isinstance(v, dict) else {"content": v} for v in value]
        elif isinstance(value, str):
            items.append({"content": value})
    return items or fallback
