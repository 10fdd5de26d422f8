"""Where stored responses live: the response object plus the conversation it ended, so a client
continues with ``previous_response_id`` and sends only its new items.

In memory by default (bounded, with a TTL), or in Redis (``--redis-url``) so any replica behind
the router can continue a conversation; the record names the replica that served it, which the
router uses to send the next turn where its KV pages are. A response belongs to its tenant:
another tenant's lookup finds nothing (404), exactly as for an unknown id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prefixgate.gateway.scaleout.keys import RESPONSE_KEY_PREFIX

logger = logging.getLogger("prefixgate.server")


@dataclass(slots=True)
class StoredResponse:
    id: str
    tenant: str
    response: dict[str, Any]  # the Response object as returned
    conversation: list[dict[str, Any]]  # chat-template messages: history + input + output
    replica_id: str | None = None


class ResponseStore(Protocol):
    async def get(self, response_id: str, tenant: str) -> StoredResponse | None: ...

    async def put(self, stored: StoredResponse) -> None: ...

    async def delete(self, response_id: str, tenant: str) -> bool: ...


class MemoryResponseStore:
    """Bounded LRU with a TTL; expired entries disappear on access or when space is needed."""

    def __init__(self, max_entries: int = 10_000, ttl_s: float = 3600.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        deadline, stored = entry
        if time.monotonic() > deadline:
            del self._entries[response_id]
            return None
        return stored if stored.tenant == tenant else None

    async def put(self, stored: StoredResponse) -> None:
        self._entries[stored.id] = (time.monotonic() + self.ttl_s, stored)
        self._entries.move_to_end(stored.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def delete(self, response_id: str, tenant: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry[1].tenant != tenant:
            return False
        del self._entries[response_id]
        return True

    def __len__(self) -> int:
        return len(self._entries)


class RedisResponseStore:
    """One JSON value per response (``prefixgate:response:<id>``) with the TTL as its expiry."""

    def __init__(self, redis: Any, ttl_s: float = 3600.0, timeout_s: float = 2.0) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s

    async def _call(self, coroutine: Any) -> Any:
        return await asyncio.wait_for(coroutine, self.timeout_s)

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        raw = await self._call(self.redis.get(RESPONSE_KEY_PREFIX + response_id))
        if raw is None:
            return None
        stored = StoredResponse(**json.loads(raw))
        return stored if stored.tenant == tenant else None

    async def put(self, stored: StoredResponse) -> None:
        await self._call(self.redis.set(RESPONSE_KEY_PREFIX + stored.id,
                                        json.dumps(asdict(stored), ensure_ascii=False),
                                        px=max(1, int(self.ttl_s * 1000))))

    async def delete(self, response_id: str, tenant: str) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        return bool(await self._call(self.redis.delete(RESPONSE_KEY_PREFIX + response_id)))

