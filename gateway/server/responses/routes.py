"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` (OpenAI's Responses API).

State: with ``store`` (the default) the response and the conversation it ended are kept
(responses/store.py), so the next turn sends ``previous_response_id`` and only its new items.
The server rebuilds the conversation exactly (the same messages, rendered the same way), so
the next prompt extends this one's tokens and every full block of it hits the cache.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from prefixgate.gateway.engine.api import EngineError, InvalidRequestError
from prefixgate.gateway.server.auth import Principal, authenticate
from prefixgate.gateway.server.errors import NotFoundError, engine_error_body, error_body
from prefixgate.gateway.server.responses.models import ResponsesRequest, dumps, output_messages
from prefixgate.gateway.server.responses.store import ResponseStore, StoredResponse
from prefixgate.gateway.server.sse import SSEResponse
from prefixgate.gateway.server.state import server_state
from prefixgate.gateway.server.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    ReasoningPiece,
    TextPiece,
)
from prefixgate.gateway.server.turn import ClientDisconnected, TurnEnd, TurnStream, open_turn

logger = logging.getLogger("prefixgate.server")
router = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


class _Builder:
    """The Response object of one request, as it grows (streamed) or all at once."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int):
        self.body = body
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.output: list[dict[str, Any]] = []

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
                "content": content if status == "completed" else []}

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def call_item(self, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        # a namespaced function goes back as name + namespace (NAMESPACE.NAME in the prompt)
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
                "call_id": call_id, **self.body.wire_call(name), "arguments": arguments,
                "status": status}

    def response(self, status: str, end: TurnEnd | None = None) -> dict[str, Any]:
        body = self.body
        usage = None
        if end is not None:
            u = end.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.total_tokens}
        fmt = body.text.format if body.text and body.text.format else None
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": list(self.output),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


def _status(end: TurnEnd) -> str:
    return "incomplete" if end.finish_reason == "length" else "completed"


def _history_calls(end: TurnEnd) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in end.calls]


async def _save(request: Request, principal: Principal, body: ResponsesRequest,
                builder: _Builder, history: list[dict[str, Any]], end: TurnEnd,
                response: dict[str, Any]) -> None:
    if not body.store:
        return
    publisher = request.app.state.publisher
    conversation = [*history, *body.input_messages(),
                    *output_messages(end.text, _history_calls(end), end.reasoning)]
    stored = StoredResponse(builder.id, principal.tenant, response, conversation,
                            publisher.config.replica_id if publisher is not None else None)
    try:
        await store_of(request).put(stored)
    except Exception:  # noqa: BLE001 - a store outage must not fail a finished response
        logger.exception("response %s could not be stored", builder.id)


async def _history(request: Request, principal: Principal, body: ResponsesRequest) -> list[dict]:
    if body.previous_response_id is None:
        return []
    stored = await store_of(request).get(body.previous_response_id, principal.tenant)
    if stored is None:
        raise InvalidRequestError(
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id", code="previous_response_not_found")
    return stored.conversation


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, response: Response,
                          principal: Principal = Depends(authenticate)):
    state = server_state(request)
    history = await _history(request, principal, body)
    turn = await open_turn(request, principal, body.turn(history), body.model)
    builder = _Builder(body, state.model_name, len(turn.prompt_ids))
    headers = _dropped_tools(request, body)
    if body.stream:
        return SSEResponse(_stream(request, principal, body, builder, history, turn), headers)
    try:
        end = await turn.collect(request)
    except ClientDisconnected:
        return Response(status_code=499)
    response.headers.update(headers)
    if end.reasoning:
        builder.output.append(builder.reasoning_item(end.reasoning))
    if end.text or not end.calls:
        builder.output.append(builder.message_item(end.text))
    builder.output.extend(builder.call_item(c.id, c.name, c.arguments) for c in end.calls)
    result = builder.response(_status(end), end)
    await _save(request, principal, body, builder, history, end, result)
    return result


DROPPED_TOOLS_HEADER = "X-Prefixgate-Dropped-Tools"


def _dropped_tools(request: Request, body: ResponsesRequest) -> dict[str, str]:
    """Hosted tools left out of the prompt: counted, logged, and named in a response header."""
    hosted = body.hosted_tools
    if not hosted:
        return {}
    server_state(request).clients.add("hosted_tools_dropped", len(hosted))
    logger.info("request %s: hosted tools left out of the prompt (this gateway cannot run "
                "them): %s", request.state.request_id, ", ".join(hosted))
    return {DROPPED_TOOLS_HEADER: ",".join(hosted)}


class _ReasoningStream:
    """The streamed reasoning item: added at the span's first piece, one
    ``response.reasoning_text.delta`` per piece, done when the answer starts."""

    def __init__(self, builder: _Builder, event: Callable[..., bytes]):
        self.builder = builder
        self.event = event
        self.item: dict[str, Any] | None = None

    def add(self, text: str) -> list[bytes]:
        out = []
        if self.item is None:
            self.item = self.builder.reasoning_item("", status="in_progress")
            self.builder.output.append(self.item)
            out.append(self.event("response.output_item.added",
                                  output_index=len(self.builder.output) - 1, item=self.item))
        self.item["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.item["id"],
                              output_index=self.builder.output.index(self.item),
                              content_index=0, delta=text))
        return out

    def close(self) -> list[bytes]:
        item, self.item = self.item, None
        if item is None:
            return []
        index = self.builder.output.index(item)
        item["status"] = "completed"
        return [self.event("response.reasoning_text.done", item_id=item["id"],
                           output_index=index, content_index=0,
                           text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def _stream(request: Request, principal: Principal, body: ResponsesRequest,
                  builder: _Builder, history: list[dict[str, Any]], turn: TurnStream
                  ) -> AsyncIterator[bytes]:
    """The semantic events, each ``event: <type>`` + ``data: {..., "sequence_number"}``."""
    sequence = 0

    def event(kind: str, **payload: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **payload}
        sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    message: dict[str, Any] | None = None  # the open message item
    text: list[str] = []
    call: dict[str, Any] | None = None  # the open function_call item
    reasoning = _ReasoningStream(builder, event)  # the open reasoning item, if any

    def close_message() -> list[bytes]:
        nonlocal message
        if message is None:
            return []
        index = builder.output.index(message)
        done = {**message, "status": "completed",
                "content": [{"type": "output_text", "text": "".join(text), "annotations": [],
                             "logprobs": []}]}
        builder.output[index] = done
        part = done["content"][0]
        out = [event("response.output_text.done", item_id=done["id"], output_index=index,
                     content_index=0, text=part["text"], logprobs=[]),
               event("response.content_part.done", item_id=done["id"], output_index=index,
                     content_index=0, part=part),
               event("response.output_item.done", output_index=index, item=done)]
        message = None
        return out

    try:
        yield event("response.created", response=builder.response("in_progress"))
        yield event("response.in_progress", response=builder.response("in_progress"))
        async for item in turn.events():
            if isinstance(item, ReasoningPiece):
                for chunk in reasoning.add(item.text):
                    yield chunk
                continue
            for chunk in reasoning.close():  # the span ended: what follows is the answer
                yield chunk
            if isinstance(item, TextPiece):
                if message is None:
                    message = builder.message_item("", status="in_progress")
                    builder.output.append(message)
                    index = len(builder.output) - 1
                    text.clear()
                    yield event("response.output_item.added", output_index=index, item=message)
                    yield event("response.content_part.added", item_id=message["id"],
                                output_index=index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                text.append(item.text)
                yield event("response.output_text.delta", item_id=message["id"],
                            output_index=builder.output.index(message), content_index=0,
                            delta=item.text, logprobs=[])
            elif isinstance(item, CallStart):
                for chunk in close_message():
                    yield chunk
                call = builder.call_item(item.id, item.name, "", status="in_progress")
                builder.output.append(call)
                yield event("response.output_item.added", output_index=len(builder.output) - 1,
                            item=call)
            elif isinstance(item, CallArguments) and call is not None:
                call["arguments"] += item.text
                yield event("response.function_call_arguments.delta", item_id=call["id"],
                            output_index=builder.output.index(call), delta=item.text)
            elif isinstance(item, CallEnd) and call is not None:
                index = builder.output.index(call)
                call.update(arguments=item.call.arguments, status="completed")
                yield event("response.function_call_arguments.done", item_id=call["id"],
                            output_index=index, name=call["name"], arguments=call["arguments"])
                yield event("response.output_item.done", output_index=index, item=call)
                call = None
            elif isinstance(item, TurnEnd):
                for chunk in close_message():
                    yield chunk
                if not builder.output:  # an empty answer is still one (empty) message
                    builder.output.append(builder.message_item(""))
                status = _status(item)
                response = builder.response(status, item)
                await _save(request, principal, body, builder, history, item, response)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield event(kind, response=response)
    except EngineError as exc:
        logger.warning("response %s failed mid-stream: %s", builder.id, exc.message)
        body_ = engine_error_body(exc)["error"]
        yield event("error", code=body_["code"], message=body_["message"], param=body_["param"])
    except Exception:
        logger.exception("response %s: internal error mid-stream", builder.id)
        body_ = error_body(f"Internal server error ({builder.id}).", "internal_error")["error"]
        yield event("error", code=None, message=body_["message"], param=None)
    finally:
        await turn.aclose()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request,
                       principal: Principal = Depends(authenticate)) -> dict[str, Any]:
    stored = await store_of(request).get(response_id, principal.tenant)
    if stored is None:
        raise NotFoundError(f"No response with id '{response_id}'.", param="response_id")
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request,
                          principal: Principal = Depends(authenticate)) -> dict[str, Any]:
    if not await store_of(request).delete(response_id, principal.tenant):
        raise NotFoundError(f"No response with id '{response_id}'.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}
