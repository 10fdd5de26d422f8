"""The registry of tool-call formats: each format module registers its instance here."""

from __future__ import annotations

from prefixgate.engine.api import InvalidRequestError
from prefixgate.gateway.server.tools.formats.base import ToolCallFormat

_FORMATS: dict[str, ToolCallFormat] = {}


def register_format(fmt: ToolCallFormat) -> ToolCallFormat:
    if fmt.name in _FORMATS:
        raise ValueError(f"tool-call format {fmt.name!r} is registered twice")
    _FORMATS[fmt.name] = fmt
    return fmt


def tool_call_formats() -> dict[str, ToolCallFormat]:
    return dict(_FORMATS)


def get_format(name: str) -> ToolCallFormat:
    """The format called ``name``; a clear error naming the others otherwise."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise InvalidRequestError(
            f"unknown tool-call format {name!r}; known: {', '.join(_FORMATS)}",
            param="tool_call_format",
        )
    return fmt


def format_for_template(template: str | None, override: str | None = None) -> ToolCallFormat | None:
    """The format ``template`` teaches (``override`` wins); None when it teaches none."""
    if override:
        return get_format(override)
    if not template:
        return None
    for fmt in sorted(_FORMATS.values(), key=lambda f: -f.priority):
        if fmt.detect(template):
            return fmt
    return None
