"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's wire protocol).

The message and its stream events are written in writer.py, from the shared turn.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from prefixgate.gateway.http.auth import Principal, authenticate
from prefixgate.gateway.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from prefixgate.gateway.server.anthropic.writer import MessagesWriter
from prefixgate.gateway.server.state import server_state
from prefixgate.gateway.server.turn import open_turn
from prefixgate.gateway.server.turn_writer import respond

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request,
                         principal: Principal = Depends(authenticate)):
    state = server_state(request)
    chat_turn = body.turn()
    state.clients.add("attribution_blocks_removed", body.attribution_removed)
    turn = await open_turn(request, principal, chat_turn, body.model)
    writer = MessagesWriter("msg_" + uuid.uuid4().hex[:24], state.model_name, state.page_size,
                            len(turn.prompt_ids))
    return await respond(request, turn, writer, body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request,
                       _: Principal = Depends(authenticate)) -> dict[str, int]:
    state = server_state(request)
    state.check_model(body.model)
    turn = body.turn()
    ids = await state.tokenization.chat_with_tools(turn.messages, turn.visible_tools, True,
                                                  turn.message_param, turn.template_kwargs)
    return {"input_tokens": len(ids)}
