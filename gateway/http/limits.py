"""Limits on slow and greedy clients, in one typed place (:class:`ConnectionLimits`), shared by
``prefixgate serve`` and ``prefixgate route``: every field is a flag of both. What enforces them
is in :mod:`gateway.http.slow_clients`.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from prefixgate.engine.setting import positive_int, setting

MIB = 1024 * 1024
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB}
_GROUP = "slow and greedy clients"


def byte_size(text: str) -> int:
    """``65536``, ``64k``, ``64KiB``, ``32MiB``, ``1g`` → bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 32MiB or 65536, got {text!r}")
    return int(match.group(1)) * _UNITS[(match.group(2) or "")[:1].lower()]


def format_byte_size(size: int) -> str:
    """Bytes as :func:`byte_size` reads them back: ``33554432`` → ``32MiB``."""
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", 1024)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be in (0, 86400] seconds, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long and how much one client may take.

    Defaults suit real agents: a long chat body with tool schemas is a few MB, a stream may run
    for minutes (no limit here applies to a response).
    """

    # connection open (or next request's first byte) → headers
    header_timeout_s: float = setting(
        15.0, flag="--header-timeout", type=_seconds, metavar="S", group=_GROUP,
        help="a connection must send a request's complete headers within S seconds of opening "
        "(or of its next request's first byte), else it is closed (408 if it sent part) "
        "(default {default})")
    body_timeout_s: float = setting(  # headers → the whole body
        60.0, flag="--body-timeout", type=_seconds, metavar="S", group=_GROUP,
        help="the whole request body must arrive within S seconds of its headers, else 408 "
        "(default {default})")
    keep_alive_timeout_s: float = setting(  # an idle kept-alive connection is closed after this
        5.0, flag="--keep-alive-timeout", type=_seconds, metavar="S", group=_GROUP,
        help="close a kept-alive connection idle for S seconds (default {default})")
    # open connections / requests in flight, then 503 (0 = no cap)
    max_connections: int = setting(
        1024, flag="--max-connections", type=_count, metavar="N", group=_GROUP,
        help="at most N open connections and N requests in flight; a request over the cap gets "
        "503 with Retry-After (default {default}; 0 = no cap). Idle sockets count until "
        "--header-timeout closes them")
    max_body_bytes: int = setting(  # request body, then 413
        32 * MIB, flag="--max-body-size", type=byte_size, metavar="SIZE", show=format_byte_size,
        group=_GROUP,
        help="request bodies over SIZE get 413, by Content-Length before reading or counted "
        "for chunked bodies (default {default}; units k, M, G, binary)")
    max_header_bytes: int = setting(  # request line + headers, then 400 (h11)
        64 * 1024, flag="--max-header-size", type=byte_size, metavar="SIZE",
        show=format_byte_size, group=_GROUP,
        help="request line plus headers over SIZE get 400 (default {default})")
    backlog: int = setting(  # connections the kernel queues before accept
        2048, flag="--backlog", type=positive_int, metavar="N", group=_GROUP,
        help="connections the kernel queues before they are accepted (default {default})")

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not 0 < getattr(self, name) <= 86_400:
                raise ValueError(f"{name} must be in (0, 86400] seconds, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0 (0 = no cap), got {self.max_connections}")
        if self.max_body_bytes < 1024 or self.max_header_bytes < 1024:
            raise ValueError("max_body_bytes and max_header_bytes must be >= 1024")
        if self.backlog < 1:
            raise ValueError(f"backlog must be >= 1, got {self.backlog}")
