"""A Responses turn written from the shared turn: the Response object (streamed as semantic
events, or whole) and its storage for ``previous_response_id``."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.requests import Request

from prefixgate.engine.api import EngineError
from prefixgate.gateway.http.auth import Principal
from prefixgate.gateway.http.errors import engine_error_body, error_body
from prefixgate.gateway.server.responses.schemas import ResponsesRequest, dumps, output_messages
from prefixgate.gateway.server.responses.store import ResponseStore, StoredResponse
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

logger = logging.getLogger("prefixgate.server")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


def usage_json(end: TurnEnd) -> dict[str, Any]:
    u = end.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def status_of(end: TurnEnd) -> str:
    return "incomplete" if end.finish_reason == "length" else "completed"


class ResponseBuilder:
    """The Response object of one request, as it grows (streamed) or all at once."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body = body
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.output: list[dict[str, Any]] = []

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
                "content": content if status == "completed" else []}

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def call_item(self, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        # a namespaced function goes back as name + namespace (NAMESPACE.NAME in the prompt)
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
                "call_id": call_id, **self.body.wire_call(name), "arguments": arguments,
                "status": status}

    def response(self, status: str, end: TurnEnd | None = None) -> dict[str, Any]:
        body = self.body
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
            "usage": usage_json(end) if end is not None else None,
            "user": body.user, "metadata": body.metadata or {},
        }


class ResponsesWriter(TurnWriter):
    """Streams ``event: <type>`` + ``data: {..., "sequence_number"}``; stores the result."""

    def __init__(self, request: Request, principal: Principal, body: ResponsesRequest,
                 history: list[dict[str, Any]], model: str):
        self.request, self.principal, self.body, self.history = request, principal, body, history
        self.builder = ResponseBuilder(body, model)
        self.log_id = f"response {self.builder.id}"
        self.sequence = 0
        self.message: dict[str, Any] | None = None  # the open message item
        self.text: list[str] = []
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse_named_event(kind, dumps(data))

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.builder.response("in_progress")),
                self.event("response.in_progress", response=self.builder.response("in_progress"))]

    def delta(self, delta: ChoiceDelta) -> list[bytes]:
        return [chunk for event in delta.events for chunk in self._item_events(event)]

    def _item_events(self, item: Event) -> list[bytes]:
        if isinstance(item, ReasoningPiece):
            return self._reasoning(item.text)
        # the span ended: what follows is the answer
        return [*self._close_reasoning(), *self._answer_events(item)]

    def _answer_events(self, item: Event) -> list[bytes]:
        if isinstance(item, TextPiece):
            return self._text(item.text)
        if isinstance(item, CallStart):
            out = self._close_message()
            self.call = self.builder.call_item(item.id, item.name, "", status="in_progress")
            self.builder.output.append(self.call)
            return [*out, self.event("response.output_item.added",
                                     output_index=len(self.builder.output) - 1, item=self.call)]
        call = self.call
        if isinstance(item, CallArguments) and call is not None:
            call["arguments"] += item.text
            return [self.event("response.function_call_arguments.delta", item_id=call["id"],
                               output_index=self.builder.output.index(call), delta=item.text)]
        if isinstance(item, CallEnd) and call is not None:
            index = self.builder.output.index(call)
            call.update(arguments=item.call.arguments, status="completed")
            self.call = None
            return [self.event("response.function_call_arguments.done", item_id=call["id"],
                               output_index=index, name=call["name"], arguments=call["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=call)]
        return []

    def _reasoning(self, text: str) -> list[bytes]:
        out = []
        if self.reasoning is None:
            self.reasoning = self.builder.reasoning_item("", status="in_progress")
            self.builder.output.append(self.reasoning)
            out.append(self.event("response.output_item.added",
                                  output_index=len(self.builder.output) - 1, item=self.reasoning))
        self.reasoning["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning["id"],
                              output_index=self.builder.output.index(self.reasoning),
                              content_index=0, delta=text))
        return out

    def _close_reasoning(self) -> list[bytes]:
        reasoning = self.reasoning
        if reasoning is None:
            return []
        index, part = self.builder.output.index(reasoning), reasoning["content"][0]
        reasoning["status"] = "completed"
        self.reasoning = None
        return [self.event("response.reasoning_text.done", item_id=reasoning["id"],
                           output_index=index, content_index=0, text=part["text"]),
                self.event("response.output_item.done", output_index=index, item=reasoning)]

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self.message is None:
            self.message = self.builder.message_item("", status="in_progress")
            self.builder.output.append(self.message)
            index = len(self.builder.output) - 1
            self.text.clear()
            out += [self.event("response.output_item.added", output_index=index, item=self.message),
                    self.event("response.content_part.added", item_id=self.message["id"],
                               output_index=index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        self.text.append(text)
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self.builder.output.index(self.message),
                              content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[bytes]:
        message = self.message
        if message is None:
            return []
        index = self.builder.output.index(message)
        part = {"type": "output_text", "text": "".join(self.text), "annotations": [],
                "logprobs": []}
        done = {**message, "status": "completed", "content": [part]}
        self.builder.output[index] = done
        self.message = None
        return [self.event("response.output_text.done", item_id=done["id"], output_index=index,
                           content_index=0, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=done["id"], output_index=index,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=done)]

    async def end(self, end: TurnEnd) -> list[bytes]:
        out = [*self._close_reasoning(), *self._close_message()]
        if not self.builder.output:  # an empty answer is still one (empty) message
            self.builder.output.append(self.builder.message_item(""))
        status = status_of(end)
        response = self.builder.response(status, end)
        await self._save(end, response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self.event(kind, response=response)]

    def error(self, exc: EngineError | None) -> list[bytes]:
        if exc is not None:
            body = engine_error_body(exc)["error"]
            return [self.event("error", code=body["code"], message=body["message"],
                               param=body["param"])]
        message = f"Internal server error ({self.builder.id})."
        body = error_body(message, "internal_error")["error"]
        return [self.event("error", code=None, message=body["message"], param=None)]

    async def whole(self, end: TurnEnd) -> dict[str, Any]:
        builder = self.builder
        if end.reasoning:
            builder.output.append(builder.reasoning_item(end.reasoning))
        if end.text or not end.calls:
            builder.output.append(builder.message_item(end.text))
        builder.output.extend(builder.call_item(c.id, c.name, c.arguments) for c in end.calls)
        result = builder.response(status_of(end), end)
        await self._save(end, result)
        return result

    async def _save(self, end: TurnEnd, response: dict[str, Any]) -> None:
        if not self.body.store:
            return
        publisher = self.request.app.state.publisher
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in end.calls]
        conversation = [*self.history, *self.body.input_messages(),
                        *output_messages(end.text, calls, end.reasoning)]
        stored = StoredResponse(self.builder.id, self.principal.tenant, response, conversation,
                                publisher.config.replica_id if publisher is not None else None)
        try:
            await store_of(self.request).put(stored)
        except Exception:  # noqa: BLE001 - a store outage must not fail a finished response
            logger.exception("response %s could not be stored", self.builder.id)
