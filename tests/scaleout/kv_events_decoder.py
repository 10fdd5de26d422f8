"""A KV-event subscriber written from llm-d's rules (llm-d-kv-cache ``vllm_adapter.go`` and
``pool.go``), independent of our encoder (plain ``msgpack``, not msgspec): what an llm-d
Endpoint Picker accepts is what this accepts.

* a message is exactly 3 frames: topic, 8-byte big-endian sequence number, msgpack payload;
* the topic is ``kv@<pod>@<model>`` (split on ``@`` into exactly three parts);
* the payload is an array ``[ts (float), events (array), dp_rank (int, optional)]``;
* an event is an array whose first element is its tag: ``BlockStored`` ``[tag, hashes,
  parent, token_ids, block_size, lora_id, medium, lora_name]``, ``BlockRemoved`` ``[tag,
  hashes, medium]``, ``AllBlocksCleared`` ``[tag]``; hashes are u64 (or bytes: last 8, BE);
* token ids are uint32 and ``len(token_ids) == len(hashes) * block_size`` (the token-length
  check: llm-d recomputes its keys from the tokens, one key per ``block_size`` tokens);
* sequence numbers are contiguous per publisher (a gap means: ask the replay socket).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack
import zmq


class Rejected(AssertionError):
    """A message llm-d would not accept."""


def _hash(raw) -> int:
    if isinstance(raw, int) and 0 <= raw < 2**64:
        return raw
    if isinstance(raw, bytes) and raw:
        return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")
    raise Rejected(f"unsupported hash {raw!r}")


@dataclass
class Decoded:
    pod: str
    model: str
    seq: int
    ts: float
    events: list[tuple]  # ("stored", hashes, parent, tokens, block_size, medium) / ("removed", hashes, medium) / ("cleared",)


def decode_message(frames: list[bytes]) -> Decoded:
    if len(frames) != 3:
        raise Rejected(f"expected 3 frames, got {len(frames)}")
    topic, seq_bytes, payload = frames
    parts = topic.decode().split("@")
    if len(parts) != 3 or parts[0] != "kv":
        raise Rejected(f"topic {topic!r} is not kv@<pod>@<model>")
    if len(seq_bytes) != 8:
        raise Rejected(f"sequence frame of {len(seq_bytes)} bytes")
    (seq,) = struct.unpack(">Q", seq_bytes)
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(batch, list) or len(batch) < 2:
        raise Rejected(f"EventBatch is not an array of >= 2: {batch!r}")
    ts, raw_events = batch[0], batch[1]
    if not isinstance(ts, float) or not isinstance(raw_events, list):
        raise Rejected("EventBatch fields: ts must be a float, events an array")
    if len(batch) > 2 and not isinstance(batch[2], int):
        raise Rejected("dp_rank must be an int")
    events = [_event(raw) for raw in raw_events]
    return Decoded(parts[1], parts[2], seq, ts, events)


def _event(raw) -> tuple:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise Rejected(f"an event is not a tagged array: {raw!r}")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise Rejected("BlockStored has fewer than 5 elements")
        hashes = [_hash(h) for h in raw[1]]
        parent = None if raw[2] is None else _hash(raw[2])
        tokens, block_size = raw[3], raw[4]
        if not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise Rejected("token ids must be uint32")
        if not isinstance(block_size, int) or block_size < 1:
            raise Rejected(f"bad block size {block_size!r}")
        if len(tokens) != len(hashes) * block_size:
            raise Rejected(f"token-length check: {len(tokens)} tokens for {len(hashes)} blocks "
                           f"of {block_size}")
        medium = raw[6] if len(raw) > 6 else None
        if medium is not None and not isinstance(medium, str):
            raise Rejected("medium must be a string")
        return ("stored", hashes, parent, tokens, block_size, medium or "GPU")
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise Rejected("BlockRemoved without hashes")
        medium = raw[2] if len(raw) > 2 else None
        return ("removed", [_hash(h) for h in raw[1]], medium or "GPU")
    if tag == "AllBlocksCleared":
        return ("cleared",)
    raise Rejected(f"unknown event tag {tag!r}")


@dataclass
class Index:
    """What a subscriber believes one pod holds: medium -> u64 hashes (and each stored hash's
    tokens, to check what was published)."""

    blocks: dict[str, set[int]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    next_seq: int | None = None
    messages: int = 0

    def apply(self, message: Decoded) -> None:
        if self.next_seq is not None and message.seq != self.next_seq:
            raise Rejected(f"sequence gap: expected {self.next_seq}, got {message.seq}")
        self.next_seq = message.seq + 1
        self.messages += 1
        for event in message.events:
            if event[0] == "stored":
                _, hashes, _, tokens, size, medium = event
                self.blocks.setdefault(medium, set()).update(hashes)
                for i, h in enumerate(hashes):
                    self.tokens[h] = tokens[i * size : (i + 1) * size]
            elif event[0] == "removed":
                self.blocks.setdefault(event[2], set()).difference_update(event[1])
            else:
                self.blocks.clear()

    def held(self, medium: str = "GPU") -> set[int]:
        return set(self.blocks.get(medium, ()))


class Subscriber:
    """A SUB socket on a publisher, topic filter ``kv@`` (llm-d's default)."""

    def __init__(self, endpoint: str, topic_filter: bytes = b"kv@"):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic_filter)
        self.socket.connect(endpoint)
        self.index = Index()
        self.decoded: list[Decoded] = []

    def drain(self, timeout_ms: int = 50) -> int:
        """Apply every message that arrives until ``timeout_ms`` passes without one."""
        n = 0
        while self.socket.poll(timeout_ms):
            message = decode_message(self.socket.recv_multipart())
            self.index.apply(message)
            self.decoded.append(message)
            n += 1
        return n

    def close(self) -> None:
        self.socket.close(linger=0)


def replay(endpoint: str, start_seq: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """vLLM's replay protocol from a DEALER: send [b"", seq], read [b"", seq, payload] until
    seq == -1. Returns 3-frame messages as the PUB would have sent them (topic left empty)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            if not sock.poll(timeout_ms):
                raise Rejected("replay did not end")
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append([seq, payload])
    finally:
        sock.close(linger=0)
