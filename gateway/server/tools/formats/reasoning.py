"""Reasoning spans (``<think>…</think>``: Qwen3, QwQ, DeepSeek R1, Granite's thinking) split
from the answer, whole or streamed, so surfaces show them as reasoning, never as content.

Some templates open the span in the generation prompt (DeepSeek R1, QwQ end the prompt with
``<think>\\n``): the output then starts inside it, which ``starts_inside`` says. A tool call
written inside or right after the span is still a call: the split runs first, and the tool
parser reads the content after it and, for a call inside the span, the reasoning too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    def detect(self, template: str) -> bool:
        return self.start in template and self.end in template


THINK = ReasoningFormat("think", "<think>", "</think>")

# OpenAI's reasoning_effort values; "none" and "minimal" turn a template's thinking off
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
_NO_THINKING = ("none", "minimal")


class TemplateKwargs(BaseModel):
    """``chat_template_kwargs``: only the reasoning switches templates read reach the template
    (anything else is a 400: a template variable such as ``bos_token`` or ``tools`` is the
    gateway's to set)."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool | None = None  # Qwen3, DeepSeek R1 distills, Granite's "thinking"
    thinking: bool | None = None  # DeepSeek V3.1 / Granite templates
    reasoning_effort: ReasoningEffort | None = None  # gpt-oss style templates


def thinking_kwargs(enabled: bool | None, effort: str | None = None) -> dict[str, Any]:
    """Template variables for a request's reasoning controls (none given: the template's
    default). ``enabled``: Anthropic's ``thinking`` type; ``effort``: OpenAI's effort."""
    out: dict[str, Any] = {}
    if effort is not None:
        out["reasoning_effort"] = effort
        enabled = effort not in _NO_THINKING if enabled is None else enabled
    if enabled is not None:
        # Qwen3 and DeepSeek R1 read enable_thinking; Granite 3.3 and DeepSeek V3.1 thinking
        out["enable_thinking"] = out["thinking"] = enabled
    return out
_REASONING: dict[str, ReasoningFormat] = {THINK.name: THINK}


def reasoning_for_template(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template uses, None when it has none."""
    if not template:
        return None
    return next((fmt for fmt in _REASONING.values() if fmt.detect(template)), None)


def starts_inside(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether the rendered prompt opened the span itself (DeepSeek R1, QwQ)."""
    return prompt_text.rstrip().endswith(fmt.start)


def _partial_suffix(text: str, token: str) -> int:
    for size in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Feed output text as it streams; get ``(reasoning, content)`` pieces.

    Args:
        fmt: the span's markers.
        starts_inside: the prompt opened the span (it ends with ``fmt.start``).
    """

    def __init__(self, fmt: ReasoningFormat = THINK, *, starts_inside: bool = False) -> None:
        self.format = fmt
        self._inside = starts_inside
        self._done = False  # one span per turn: later markers are content
        self._buffer = ""
        self._strip_newlines = False  # the newlines after a closed span are not content
        # a span's leading whitespace, held until text follows: an empty span (a model that
        # chose not to think, a forced call closing the span the prompt opened) is no reasoning
        self._held: str | None = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self._done:
                if self._strip_newlines:
                    self._buffer = self._buffer.lstrip("\n")
                    self._strip_newlines = not self._buffer
                content.append(self._buffer)
                self._buffer = ""
                break
            if not self._inside:  # the start of the output: a span opens it, or there is none
                stripped = self._buffer.lstrip()
                if stripped.startswith(self.format.start):
                    self._buffer, self._inside = stripped[len(self.format.start) :], True
                elif self.format.start.startswith(stripped):
                    break  # whitespace or part of the marker so far: wait for more
                else:
                    self._done = True
                continue
            at = self._buffer.find(self.format.end)
            if at < 0:
                keep = _partial_suffix(self._buffer, self.format.end)
                self._reason(self._buffer[: len(self._buffer) - keep], reasoning)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._reason(self._buffer[:at], reasoning)
            self._buffer = self._buffer[at + len(self.format.end) :]
            self._inside, self._done, self._strip_newlines = False, True, True
        return "".join(reasoning), "".join(content)

    def _reason(self, text: str, out: list[str]) -> None:
        if self._held is None:
            out.append(text)
            return
        self._held += text
        if self._held.strip():
            out.append(self._held)
            self._held = None

    def finish(self) -> tuple[str, str]:
        """Flush: an unclosed span is reasoning; anything else content."""
        rest, self._buffer = self._buffer, ""
        if not self._inside:
            return "", rest
        reasoning: list[str] = []
        self._reason(rest, reasoning)
        return "".join(reasoning), ""


def split_reasoning(
    text: str, fmt: ReasoningFormat = THINK, *, starts_inside: bool = False
) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole output."""
    splitter = ReasoningSplitter(fmt, starts_inside=starts_inside)
    first, last = splitter.feed(text), splitter.finish()
    return first[0] + last[0], first[1] + last[1]
