"""The Redis key schema shared by the replicas (writers) and the router (reader).

    {ns}:blk:<16-byte block hash>   SET of replica ids holding that full block (hittable)
    {ns}:replica:<id>:blocks        SET of the block hashes one replica holds (cleanup, resync)
    {ns}:replica:<id>:heartbeat     JSON Heartbeat, expires after the heartbeat TTL
    {ns}:replicas                   SET of replica ids that publish (the janitor's list)
    {ns}:stats:<id>:<epoch>         JSON cumulative hit counters of one replica process
    {ns}:stats                      SET of those snapshot keys (the router sums them)
    {ns}:janitor                    short lock: one router at a time reaps dead replicas
    {ns}:kv:<16-byte block hash>    one block's K/V in the fleet's second tier (--kv-tier redis)

Block keys hold raw digest bytes (not hex): the index is the biggest thing in Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "prefixgate"
# stored Responses API responses (previous_response_id), written by a replica's response store
# and read by the router, which places a continuation where its conversation's prefix lives;
# outside the fleet namespace: a response id is unique on its own
RESPONSE_KEY_PREFIX = "prefixgate:response:"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one namespace (several fleets may share a Redis)."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise ValueError(f"invalid Redis namespace {self.namespace!r}")

    def block(self, block_hash: bytes) -> bytes:
        return self.namespace.encode() + b":blk:" + block_hash

    def tier_entry(self, block_hash: bytes) -> bytes:
        """A tier entry (gateway/scaleout/kv_tier_redis.py); the router checks these exist."""
        return self.namespace.encode() + b":kv:" + block_hash

    def replica_blocks(self, replica_id: str) -> str:
        return f"{self.namespace}:replica:{replica_id}:blocks"

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.namespace}:replica:{replica_id}:heartbeat"

    @property
    def replicas(self) -> str:
        return f"{self.namespace}:replicas"

    def stats_snapshot(self, replica_id: str, epoch: str) -> str:
        return f"{self.namespace}:stats:{replica_id}:{epoch}"

    @property
    def stats_index(self) -> str:
        return f"{self.namespace}:stats"

    @property
    def janitor(self) -> str:
        return f"{self.namespace}:janitor"
