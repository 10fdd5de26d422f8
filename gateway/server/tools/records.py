"""Surface-neutral tool records: what every API surface (OpenAI chat, Responses, Anthropic
Messages) translates its own tool fields into before the shared prompt/grammar/parser code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ToolMode = Literal["none", "auto", "required", "function"]

# An object schema with no properties: what a function without ``parameters`` takes.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One callable function. ``parameters`` is its JSON schema (an object schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``none`` hides the tools; ``auto`` text or calls; ``required`` at least one call;
    ``function`` exactly one call of ``name``. ``parallel``: more than one call allowed."""

    mode: ToolMode = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class ToolCallOutput:
    """One parsed call. ``arguments`` is the JSON text as generated (a string, as OpenAI sends
    it); ``complete`` is False when the output was cut (max_tokens) inside the call."""

    index: int
    id: str
    name: str
    arguments: str
    complete: bool = True
