"""Scale-out, replica side: publish the block index, heartbeat/load and fleet stats to Redis.

The router (gateway/router) reads what this package writes; the key schema in ``keys.py`` and
the :class:`Heartbeat` record are the contract between them.
"""

from prefixgate.gateway.scaleout.event_buffer import EventBuffer
from prefixgate.gateway.scaleout.fleet_stats import FleetStats, read_fleet_stats
from prefixgate.gateway.scaleout.heartbeat import Heartbeat
from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE, RedisKeys
from prefixgate.gateway.scaleout.publisher import PublisherConfig, ReplicaPublisher

__all__ = [
    "DEFAULT_NAMESPACE",
    "EventBuffer",
    "FleetStats",
    "Heartbeat",
    "PublisherConfig",
    "RedisKeys",
    "ReplicaPublisher",
    "read_fleet_stats",
]
