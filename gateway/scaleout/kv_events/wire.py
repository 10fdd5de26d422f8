"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), written from its
definition.

A message is three ZMQ frames: the topic, an 8-byte big-endian sequence number, and a msgpack
``EventBatch``. Batches and events are msgspec structs encoded as arrays; an event is a tagged
array whose first element is its class name::

    EventBatch       [ts, [event, ...], dp_rank]
    BlockStored      ["BlockStored", [hash, ...], parent | nil, [token id, ...], block_size,
                      lora_id | nil, medium, lora_name | nil]
    BlockRemoved     ["BlockRemoved", [hash, ...], medium]
    AllBlocksCleared ["AllBlocksCleared"]

Hashes are u64: our xxh3-128 block keys cut to their last 8 bytes read big-endian, which is
how vLLM turns a bytes hash into an int and how llm-d reads a bytes hash.
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # the KV pool itself (vLLM's name for it, on CPU-only replicas too)
MEDIUM_BY_TIER = {"host": "CPU", "disk": "DISK", "redis": "REDIS"}  # second-tier stores
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's end marker (vLLM)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def u64(block_hash: bytes) -> int:
    """A block key as vLLM's external u64 hash: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def default_topic(model: str, host: str | None = None) -> str:
    """``kv@<host>@<model>``: llm-d's subscriber splits the topic on ``@`` into pod and model."""
    return f"kv@{host or socket.gethostname()}@{model}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload (tests and tools; raises ``msgspec.DecodeError`` on a bad one)."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
