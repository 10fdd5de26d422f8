"""Scale-out, replica side: publish the block index, heartbeat/load and fleet stats to Redis.

The router (gateway/router) reads what this package writes; the key schema in ``keys.py`` and
the :class:`Heartbeat` record are the contract between them.
"""

from gateway.scaleout.event_buffer import EventBuffer
from gateway.scaleout.fleet_stats import FleetStats, read_fleet_stats
from gateway.scaleout.heartbeat import Heartbeat
from gateway.scaleout.keys import DEFAULT_NAMESPACE, RedisKeys
from gateway.scaleout.publisher import PublisherConfig, ReplicaPublisher

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
