"""Limits on slow and greedy clients, in one typed place (:class:`ConnectionLimits`), and
their flags, shared by ``prefixgate serve`` and ``prefixgate route``. What enforces them is in
:mod:`gateway.server.slow_clients`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long and how much one client may take; every field is a flag (see :func:`add_limit_flags`).

    Defaults suit real agents: a long chat body with tool schemas is a few MB, a stream may run
    for minutes (no limit here applies to a response).
    """

    header_timeout_s: float = 15.0  # connection open (or next request's first byte) → headers
    body_timeout_s: float = 60.0  # headers → the whole body
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 1024  # open connections / requests in flight, then 503 (0 = no cap)
    max_body_bytes: int = 32 * MIB  # request body, then 413
    max_header_bytes: int = 64 * 1024  # request line + headers, then 400 (h11)
    backlog: int = 2048  # connections the kernel queues before accept

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


# --------------------------------------------------------------------------- flags

_DEFAULT = ConnectionLimits()
LIMIT_DEFAULTS: dict[str, Any] = {
    "header_timeout": _DEFAULT.header_timeout_s,
    "body_timeout": _DEFAULT.body_timeout_s,
    "keep_alive_timeout": _DEFAULT.keep_alive_timeout_s,
    "max_connections": _DEFAULT.max_connections,
    "max_body_size": _DEFAULT.max_body_bytes,
    "max_header_size": _DEFAULT.max_header_bytes,
    "backlog": _DEFAULT.backlog,
}

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB}


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


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The slow/greedy-client flags, one group, shared by ``serve`` and ``route``."""
    group = parser.add_argument_group(
        "slow and greedy clients",
        "limits per connection and request; none applies to a response, so streams are never cut",
    )
    group.add_argument(
        "--header-timeout", type=_seconds, metavar="S",
        help="a connection must send a request's complete headers within S seconds of opening "
        "(or of its next request's first byte), else it is closed (408 if it sent part) "
        "(default {default})",
    )
    group.add_argument(
        "--body-timeout", type=_seconds, metavar="S",
        help="the whole request body must arrive within S seconds of its headers, else 408 "
        "(default {default})",
    )
    group.add_argument(
        "--keep-alive-timeout", type=_seconds, metavar="S",
        help="close a kept-alive connection idle for S seconds (default {default})",
    )
    group.add_argument(
        "--max-connections", type=_count, metavar="N",
        help="at most N open connections and N requests in flight; a request over the cap gets "
        "503 with Retry-After (default {default}; 0 = no cap). Idle sockets count until "
        "--header-timeout closes them",
    )
    group.add_argument(
        "--max-body-size", type=byte_size, metavar="SIZE",
        help="request bodies over SIZE get 413, by Content-Length before reading or counted "
        "for chunked bodies (default {default}; units k, M, G, binary)",
    )
    group.add_argument(
        "--max-header-size", type=byte_size, metavar="SIZE",
        help="request line plus headers over SIZE get 400 (default {default})",
    )
    group.add_argument(
        "--backlog", type=_positive, metavar="N",
        help="connections the kernel queues before they are accepted (default {default})",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def limits_from_values(values: Mapping[str, Any]) -> ConnectionLimits:
    """Resolved flag values (see :data:`LIMIT_DEFAULTS`) → :class:`ConnectionLimits`."""
    return ConnectionLimits(
        header_timeout_s=values["header_timeout"],
        body_timeout_s=values["body_timeout"],
        keep_alive_timeout_s=values["keep_alive_timeout"],
        max_connections=values["max_connections"],
        max_body_bytes=values["max_body_size"],
        max_header_bytes=values["max_header_size"],
        backlog=values["backlog"],
    )
