"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's wire protocol).

Usage follows Anthropic's accounting, from the real page hits: ``cache_read_input_tokens`` =
prompt tokens served from cached pages; ``cache_creation_input_tokens`` = prompt tokens in
full blocks this request computed (and so cached for the next one); ``input_tokens`` = the
rest (the partial last block). The three add up to the prompt.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from prefixgate.gateway.engine.api import EngineError, Usage
from prefixgate.gateway.server.anthropic.errors import anthropic_error_body
from prefixgate.gateway.server.anthropic.models import CountTokensRequest, MessagesRequest
from prefixgate.gateway.server.auth import Principal, authenticate
from prefixgate.gateway.server.sse import SSEResponse
from prefixgate.gateway.server.state import server_state
from prefixgate.gateway.server.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    ReasoningPiece,
    TextPiece,
)
from prefixgate.gateway.server.turn import ClientDisconnected, TurnEnd, open_turn

logger = logging.getLogger("prefixgate.server")
router = APIRouter()


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


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


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request,
                         principal: Principal = Depends(authenticate)):
    state = server_state(request)
    chat_turn = body.turn()
    state.clients.add("attribution_blocks_removed", body.attribution_removed)
    turn = await open_turn(request, principal, chat_turn, body.model)
    message_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return SSEResponse(_stream(turn, message_id, state.model_name, state.page_size))
    try:
        end = await turn.collect(request)
    except ClientDisconnected:
        return Response(status_code=499)
    content: list[dict[str, Any]] = []
    if end.reasoning:
        content.append({"type": "thinking", "thinking": end.reasoning, "signature": ""})
    if end.text:
        content.append({"type": "text", "text": end.text})
    for call in end.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": _input(call.arguments)})
    return _message(message_id, state.model_name, content, end, usage_of(end.usage, state.page_size))


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


async def _stream(turn, message_id: str, model: str, page_size: int) -> AsyncIterator[bytes]:
    """message_start, content blocks (text_delta / input_json_delta), message_delta, stop."""
    start_usage = {"input_tokens": len(turn.prompt_ids), "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0, "output_tokens": 0}
    blocks = _Blocks()
    try:
        yield _event("message_start", {"type": "message_start",
                                       "message": _message(message_id, model, [], None, start_usage)})
        yield _event("ping", {"type": "ping"})
        async for event in turn.events():
            out: list[bytes] = []
            if isinstance(event, ReasoningPiece):
                if blocks.kind != "thinking":
                    out += blocks.start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(blocks.delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, TextPiece):
                if blocks.kind != "text":
                    out += blocks.start({"type": "text", "text": ""})
                out.append(blocks.delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, CallStart):
                out += blocks.start({"type": "tool_use", "id": tool_use_id(event.id),
                                     "name": event.name, "input": {}})
            elif isinstance(event, CallArguments):
                out.append(blocks.delta({"type": "input_json_delta", "partial_json": event.text}))
            elif isinstance(event, CallEnd):
                out += blocks.close()
            elif isinstance(event, TurnEnd):
                out += blocks.close()
                out.append(_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(event), "stop_sequence": event.matched_stop},
                    "usage": usage_of(event.usage, page_size)}))
                out.append(_event("message_stop", {"type": "message_stop"}))
            for chunk in out:
                yield chunk
    except EngineError as exc:
        logger.warning("message %s failed mid-stream: %s", message_id, exc.message)
        yield _event("error", anthropic_error_body(exc.status_code, exc.message, exc.param))
    except Exception:
        logger.exception("message %s: internal error mid-stream", message_id)
        yield _event("error", anthropic_error_body(500, f"Internal server error ({message_id})."))
    finally:
        await turn.aclose()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request,
                       _: Principal = Depends(authenticate)) -> dict[str, int]:
    state = server_state(request)
    state.check_model(body.model)
    turn = body.turn()
    ids = await state.tokenization.chat_with_tools(turn.messages, turn.visible_tools, True,
                                                  turn.message_param, turn.template_kwargs)
    return {"input_tokens": len(ids)}
