"""OpenAI-compatible endpoints: chat and text completions, models, tokenize / detokenize, and
cache pin / unpin (they take /tokenize's inputs; what pinning does is routes_cache.pin_prefix).

Routes stay thin: validate (pydantic), authenticate (tenant), translate the request into the
neutral turn and open it (gateway/server/turn.py: errors surface here, before any byte is
sent), then let the shared serving path stream SSE chunks or collect one JSON response, written
by writer.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from prefixgate.engine.kernel_report import engine_kernel_report
from prefixgate.gateway.http.auth import Principal, authenticate, require_admin
from prefixgate.gateway.server.openai.render import RenderedPrompt, render
from prefixgate.gateway.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PinRequest,
    TokenizeRequest,
    TokenizeResponse,
    template_tools,
)
from prefixgate.gateway.server.openai.writer import ChatWriter, CompletionWriter
from prefixgate.gateway.server.routes_cache import PinResponse, pin_prefix
from prefixgate.gateway.server.state import ServerState, server_state
from prefixgate.gateway.server.turn import open_turn
from prefixgate.gateway.server.turn_writer import respond

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: Principal = Depends(authenticate)
):
    turn = await open_turn(request, principal, body.turn(), body.model)
    writer = ChatWriter(body, server_state(request).model_name, request.state.request_id)
    return await respond(request, turn, writer, body.stream)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, principal: Principal = Depends(authenticate)
):
    turn = await open_turn(request, principal, body.turn(), body.model)
    writer = CompletionWriter(body, server_state(request).model_name, request.state.request_id)
    return await respond(request, turn, writer, body.stream)


@router.post("/v1/chat/completions/render")
async def render_chat_completion(
    body: ChatCompletionRequest, request: Request, _: Principal = Depends(authenticate)
) -> RenderedPrompt:
    """The prompt token ids /v1/chat/completions would run, without running it (vLLM's)."""
    state = server_state(request)
    state.check_model(body.model)
    return (await render(state, body.turn(), request.state.request_id))[0]


@router.post("/v1/completions/render")
async def render_completion(
    body: CompletionRequest, request: Request, _: Principal = Depends(authenticate)
) -> list[RenderedPrompt]:
    """The prompt token ids /v1/completions would run, one entry per prompt (vLLM's)."""
    state = server_state(request)
    state.check_model(body.model)
    return await render(state, body.turn(), request.state.request_id)


@router.get("/v1/models")
async def list_models(request: Request, _: Principal = Depends(authenticate)) -> ModelList:
    state: ServerState = server_state(request)
    kernels = engine_kernel_report(state.engine)
    return ModelList(
        data=[
            ModelCard(
                id=state.model_name, created=state.created, max_model_len=state.engine.max_model_len,
                root=state.engine.model_name, parent=None,  # no adapters: every card a base model
                # stand-in engines (tests) may not say
                dtype=getattr(state.engine, "dtype", None),
                kv_dtype=getattr(state.engine, "kv_dtype", None),
                kernel_backend=kernels.backend if kernels else None,
                kernel_fallback_reason=kernels.fallback_reason if kernels else None,
            )
        ]
    )


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest, request: Request, _: Principal = Depends(authenticate)
) -> TokenizeResponse:
    """Token ids exactly as the completion endpoints would compute them (chat template included)."""
    state = server_state(request)
    state.check_model(body.model)
    tokens = await tokens_of(state, body)
    return TokenizeResponse(
        tokens=tokens, count=len(tokens), max_model_len=state.engine.max_model_len
    )


async def tokens_of(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        messages = [m.template_dict() for m in body.messages]
        tools = template_tools(body.tools, body.tool_choice)
        return await state.tokenization.chat_with_tools(messages, tools, body.add_generation_prompt)
    assert body.prompt is not None  # guaranteed by TokenizeRequest's validator
    return await state.tokenization.text(body.prompt, body.add_special_tokens)


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest, request: Request, _: Principal = Depends(authenticate)
) -> DetokenizeResponse:
    state = server_state(request)
    state.check_model(body.model)
    return DetokenizeResponse(prompt=await state.tokenization.decode(body.tokens))


async def _pin_or_unpin(
    request: Request, body: PinRequest, principal: Principal, pin: bool
) -> PinResponse:
    state = server_state(request)
    state.check_model(body.model)
    tokens = await tokens_of(state, body)
    return await pin_prefix(state, tokens, body.tenant or principal.tenant, body.cache_salt, pin)


@router.post("/v1/cache/pin")
async def pin(
    body: PinRequest, request: Request, principal: Principal = Depends(require_admin)
) -> PinResponse:
    """Keep the full blocks of a prompt (e.g. an agent's system prompt) from ever being evicted."""
    return await _pin_or_unpin(request, body, principal, pin=True)


@router.post("/v1/cache/unpin")
async def unpin(
    body: PinRequest, request: Request, principal: Principal = Depends(require_admin)
) -> PinResponse:
    return await _pin_or_unpin(request, body, principal, pin=False)
