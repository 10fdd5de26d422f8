"""What real agent clients send by default, made to work (docs/clients.md): model-name aliases,
Claude Code's attribution block, and the counters an operator reads in /v1/cache/stats.

Everything here is surface-neutral; each surface calls it while it translates its request.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass

# Claude Code (>= 2.1.36) opens its system prompt with a billing line, e.g.
# ``x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=0f3a9;``. In
# interactive sessions ``cch`` (and in some builds the version's suffix) change on every
# request, so a prompt that starts with it never shares its first block with the last turn.
# It is metadata for Anthropic's billing, not an instruction: the gateway leaves it out of the
# prompt. Only a block (or first line) made of nothing but ``key=value;`` pairs is taken.
_ATTRIBUTION = re.compile(
    r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]{1,64}=[^;\n]{0,256};){0,16}[ \t]*")


def is_attribution(text: str) -> bool:
    """Whether ``text`` is exactly one attribution line (a whole system block)."""
    return _ATTRIBUTION.fullmatch(text.strip()) is not None


def strip_attribution(text: str) -> tuple[str, bool]:
    """``text`` without a leading attribution line; and whether one was there."""
    head, newline, rest = text.partition("\n")
    if is_attribution(head):
        return rest if newline else "", True
    return text, False


def model_served(name: str, served: str, aliases: tuple[str, ...]) -> bool:
    """Whether a request's ``model`` names the served model: its own name or an alias glob."""
    return name == served or any(fnmatch.fnmatchcase(name, alias) for alias in aliases)


@dataclass(slots=True)
class ClientCounters:
    """How often the gateway adapted what a client sent (shown in /v1/cache/stats)."""

    attribution_blocks_removed: int = 0  # Claude Code billing lines kept out of prompts
    hosted_tools_dropped: int = 0  # Responses tools of a hosted type (web_search, ...)
    max_tokens_clamped: int = 0  # a max_tokens (or the default) cut to the room left
    default_max_tokens_applied: int = 0  # requests without max_tokens given --default-max-tokens
    repeated_calls_cut: int = 0  # turns ended at an exact repeat of a call (tools/repeats.py)

    # NOTE: only the event loop's thread (the routes) adds to them: no lock needed
    def add(self, counter: str, amount: int = 1) -> None:
        setattr(self, counter, getattr(self, counter) + amount)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
