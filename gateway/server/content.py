"""Shared validation of content parts / blocks across the API surfaces (text-only model)."""

from __future__ import annotations

from typing import Any


def require_part_types(message: Any, allowed: tuple[str, ...], noun: str) -> Any:
    """A ``mode="before"`` validator body: every part of ``message["content"]`` (when it is a
    list) has a ``type`` in ``allowed``; otherwise a ValueError naming the part and its type."""
    parts = message.get("content") if isinstance(message, dict) else None
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in allowed:
                raise ValueError(f"content {noun} {i} has type {kind!r}; this text-only model "
                                 f"takes {', '.join(allowed)} {noun}s")
    return message
