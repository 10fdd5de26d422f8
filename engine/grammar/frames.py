"""Length-prefixed JSON frames: how the server and its grammar-compile workers talk over pipes.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. The reading side of
the server waits with a deadline (:func:`read_frame_until`), so a worker that hangs is noticed
at its deadline instead of blocking the caller forever.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import IO, Any

_HEADER = struct.Struct(">I")


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    """Write one frame and flush it."""
    body = json.dumps(message, ensure_ascii=False).encode()
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """Read one frame, blocking; None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    body = stream.read(length)
    if len(body) < length:
        return None
    return json.loads(body)


class FrameTimeout(TimeoutError):
    """The other side sent no whole frame before the deadline."""


def read_frame_until(fd: int, deadline: float) -> dict[str, Any] | None:
    """Read one frame from the raw file descriptor ``fd`` by ``deadline`` (time.monotonic());
    None at end of stream.

    Raises:
        FrameTimeout: the deadline passed first.
    """
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exact(fd, length, deadline)
    return None if body is None else json.loads(body)


def _read_exact(fd: int, size: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    left = size
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise FrameTimeout
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise FrameTimeout
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
