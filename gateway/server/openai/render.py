"""``/v1/chat/completions/render`` and ``/v1/completions/render``: a request's prompt token
ids exactly as the completion endpoints compute them (chat template, tools), without running
it. vLLM's render endpoints, which llm-d's Endpoint Picker calls to hash a prompt into the
same blocks the KV events publish (docs/fleet.md). Chat answers one object, completions a
list (one per prompt), as vLLM does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from prefixgate.gateway.server.state import ServerState
from prefixgate.gateway.server.turn import ChatTurn, render_prompts, sampling_params


class RenderedPrompt(BaseModel):
    request_id: str
    model: str
    token_ids: list[int]
    features: None = None  # multimodal features: none (text models only)
    sampling_params: dict[str, Any]
    cache_salt: str | None = None


async def render(state: ServerState, turn: ChatTurn, request_id: str) -> list[RenderedPrompt]:
    """One rendered prompt per prompt of ``turn`` (a chat turn has one)."""
    out = []
    for prompt in await render_prompts(state, turn):
        params = sampling_params(turn, len(prompt), state.capacity, state.page_size,
                                 settings=state.settings)
        out.append(RenderedPrompt(
            request_id=request_id, model=state.model_name, token_ids=prompt,
            sampling_params={"max_tokens": params.max_tokens, "temperature": params.temperature,
                             "top_p": params.top_p, "n": params.n},
            cache_salt=turn.cache_salt))
    return out
