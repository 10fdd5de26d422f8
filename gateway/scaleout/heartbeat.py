"""A replica's heartbeat: who it is, where it listens, how it hashes, how loaded it is.

Written with a TTL; a router treats a replica whose heartbeat expired as gone. The hashing
facts (model id, page size, seed) let the router check it computes the same block hashes.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True, slots=True)
class Heartbeat:
    replica_id: str
    url: str  # where the router reaches it (--advertise-url)
    model_id: str  # enters the block hash (the loaded model's own name)
    served_model: str  # the OpenAI model name
    page_size: int
    hash_seed: int
    num_running: int
    num_waiting: int
    max_waiting: int
    num_pages: int
    pages_free: int  # allocatable now: free + free-but-cached
    auth_enabled: bool
    started_at: float  # unix time the publisher started
    sent_at: float  # unix time of this beat
    # the second KV tier: "redis" = the fleet's shared tier, whose blocks this replica can
    # load (the router scores them); "host"/"disk" = private, invisible to the router
    kv_tier: str = ""
    # the fraction of a recompute a tier block saves on this replica (measured; None = not yet)
    tier_discount: float | None = None

    @property
    def pages_used(self) -> int:
        """Pages referenced by live sequences."""
        return self.num_pages - self.pages_free

    @property
    def load(self) -> int:
        """Requests the replica holds (running + waiting)."""
        return self.num_running + self.num_waiting

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        """Parse a heartbeat; ValueError naming the problem on anything malformed."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"heartbeat is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("heartbeat is not a JSON object")
        names = {f.name for f in fields(cls)}
        # fields with a default were added later: a beat from an older replica lacks them
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = required - data.keys()
        if missing:
            raise ValueError(f"heartbeat lacks {', '.join(sorted(missing))}")
        try:
            return cls(**{name: data[name] for name in names if name in data})
        except TypeError as exc:
            raise ValueError(f"malformed heartbeat: {exc}") from None
