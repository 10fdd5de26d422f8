"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` (OpenAI's Responses API).

State: with ``store`` (the default) the response and the conversation it ended are kept
(responses/store.py), so the next turn sends ``previous_response_id`` and only its new items.
The server rebuilds the conversation exactly (the same messages, rendered the same way), so
the next prompt extends this one's tokens and every full block of it hits the cache. The
Response object and its events are written in writer.py.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from prefixgate.engine.api import InvalidRequestError
from prefixgate.gateway.http.auth import Principal, authenticate
from prefixgate.gateway.http.errors import NotFoundError
from prefixgate.gateway.server.responses.schemas import ResponsesRequest
from prefixgate.gateway.server.responses.writer import ResponsesWriter, store_of
from prefixgate.gateway.server.state import server_state
from prefixgate.gateway.server.turn import open_turn
from prefixgate.gateway.server.turn_writer import respond

logger = logging.getLogger("prefixgate.server")
router = APIRouter()

DROPPED_TOOLS_HEADER = "X-Prefixgate-Dropped-Tools"


async def _history(request: Request, principal: Principal, body: ResponsesRequest) -> list[dict]:
    if body.previous_response_id is None:
        return []
    stored = await store_of(request).get(body.previous_response_id, principal.tenant)
    if stored is None:
        raise InvalidRequestError(
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id", code="previous_response_not_found")
    return stored.conversation


def _dropped_tools(request: Request, body: ResponsesRequest) -> dict[str, str]:
    """Hosted tools left out of the prompt: counted, logged, and named in a response header."""
    hosted = body.hosted_tools
    if not hosted:
        return {}
    server_state(request).clients.add("hosted_tools_dropped", len(hosted))
    logger.info("request %s: hosted tools left out of the prompt (this gateway cannot run "
                "them): %s", request.state.request_id, ", ".join(hosted))
    return {DROPPED_TOOLS_HEADER: ",".join(hosted)}


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, response: Response,
                          principal: Principal = Depends(authenticate)):
    history = await _history(request, principal, body)
    turn = await open_turn(request, principal, body.turn(history), body.model)
    writer = ResponsesWriter(request, principal, body, history, server_state(request).model_name)
    headers = _dropped_tools(request, body)
    response.headers.update(headers)  # the whole response's; a stream carries them itself
    return await respond(request, turn, writer, body.stream, headers)


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
