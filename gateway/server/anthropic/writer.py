"""An Anthropic Messages turn written from the shared turn: the message (whole, or streamed as
content blocks) in Anthropic's shapes.

Usage follows Anthropic's accounting, from the real page hits: ``cache_read_input_tokens`` =
prompt tokens served from cached pages; ``cache_creation_input_tokens`` = prompt tokens in
full blocks this request computed (and so cached for the next one); ``input_tokens`` = the
rest (the partial last block). The three add up to the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from prefixgate.engine.api import EngineError, Usage
from prefixgate.gateway.http.errors import anthropic_error_body
from prefixgate.gateway.server.sse import sse_named_event
from prefixgate.gateway.server.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    Event,
    ReasoningPiece,
    TextPiece,
)
from prefixgate.gateway.server.turn_stream import ChoiceDelta, TurnEnd
from prefixgate.gateway.server.turn_writer import TurnWriter


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return sse_named_event(name, json.dumps(payload, separators=(",", ":")))


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage_of(usage: Usage, page_size: int) -> dict[str, int]:
    full_blocks = usage.prompt_tokens // page_size * page_size
    created = max(0, full_blocks - usage.cached_tokens)
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_reason(end: TurnEnd) -> str:
    if end.finish_reason == "length":
        return "max_tokens"
    if end.calls and all(c.complete for c in end.calls):
        return "tool_use"
    return "stop_sequence" if end.matched_stop is not None else "end_turn"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(message_id: str, model: str, content: list[dict[str, Any]], end: TurnEnd | None,
             usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content,
        "stop_reason": stop_reason(end) if end else None,
        "stop_sequence": end.matched_stop if end else None,
        "usage": usage,
    }


class _Blocks:
    """The open content block of a streamed message: starting one closes the last."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        out.append(_event("content_block_start", {"type": "content_block_start",
                                                  "index": self.index, "content_block": block}))
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                              "delta": delta})


class MessagesWriter(TurnWriter):
    """message_start, content blocks (text_delta / input_json_delta), message_delta, stop."""

    def __init__(self, message_id: str, model: str, page_size: int, prompt_tokens: int):
        self.message_id, self.model, self.page_size = message_id, model, page_size
        self.prompt_tokens = prompt_tokens
        self.log_id = f"message {message_id}"
        self.blocks = _Blocks()

    def start(self) -> list[bytes]:
        usage = {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0, "output_tokens": 0}
        message = _message(self.message_id, self.model, [], None, usage)
        return [_event("message_start", {"type": "message_start", "message": message}),
                _event("ping", {"type": "ping"})]

    def delta(self, delta: ChoiceDelta) -> list[bytes]:
        return [chunk for event in delta.events for chunk in self._block_events(event)]

    def _block_events(self, event: Event) -> list[bytes]:
        blocks = self.blocks
        if isinstance(event, ReasoningPiece):
            out = (blocks.start({"type": "thinking", "thinking": "", "signature": ""})
                   if blocks.kind != "thinking" else [])
            return [*out, blocks.delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, TextPiece):
            out = blocks.start({"type": "text", "text": ""}) if blocks.kind != "text" else []
            return [*out, blocks.delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            return blocks.start({"type": "tool_use", "id": tool_use_id(event.id),
                                 "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            return [blocks.delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, CallEnd):
            return blocks.close()
        return []

    async def end(self, end: TurnEnd) -> list[bytes]:
        delta = {"stop_reason": stop_reason(end), "stop_sequence": end.matched_stop}
        return [*self.blocks.close(),
                _event("message_delta", {"type": "message_delta", "delta": delta,
                                         "usage": usage_of(end.usage, self.page_size)}),
                _event("message_stop", {"type": "message_stop"})]

    def error(self, exc: EngineError | None) -> list[bytes]:
        if exc is not None:
            return [_event("error", anthropic_error_body(exc.status_code, exc.message, exc.param))]
        message = f"Internal server error ({self.message_id})."
        return [_event("error", anthropic_error_body(500, message))]

    async def whole(self, end: TurnEnd) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if end.reasoning:
            content.append({"type": "thinking", "thinking": end.reasoning, "signature": ""})
        if end.text:
            content.append({"type": "text", "text": end.text})
        for call in end.calls:
            content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                            "input": _input(call.arguments)})
        return _message(self.message_id, self.model, content, end,
                        usage_of(end.usage, self.page_size))
