"""One assistant turn over the engine: the pipeline every API surface shares (OpenAI chat and
text completions, OpenAI Responses, Anthropic Messages).

A surface translates its wire request into a :class:`ChatTurn` (chat-template messages or raw
prompts, neutral tools, tool choice, sampling), opens it with :func:`open_turn`, and encodes
what the :class:`TurnStream` yields (per-choice deltas split into text and tool-call events,
then a :class:`TurnEnd`) in its own format (gateway/server/turn_writer.py runs the stream). Prompt
rendering, grammars, tenancy, ``cache_salt``, retention and stats are therefore identical
whichever surface a request arrives on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from prefixgate.engine.api import (
    ContextLengthError,
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
)
from prefixgate.gateway.http.auth import Principal
from prefixgate.gateway.http.disconnect import ClientDisconnected
from prefixgate.gateway.server.clients import ClientCounters
from prefixgate.gateway.server.generation import open_streams
from prefixgate.gateway.server.retention import (
    note_arrival,
    retain_later,
    retain_tool_pause,
    retention_ttl,
)
from prefixgate.gateway.server.settings import ServerSettings
from prefixgate.gateway.server.state import ServerState, agent_of, engine_request_id, server_state
from prefixgate.gateway.server.tools import FunctionTool, ToolChoice
from prefixgate.gateway.server.turn_stream import (
    ChoiceDelta,
    ChoiceOutput,
    OutputSplitter,
    TurnEnd,
    TurnStream,
)

logger = logging.getLogger("prefixgate.server")
_DEFAULT_SETTINGS = ServerSettings()  # what sampling_params falls back to without settings


@dataclass(slots=True)
class ChatTurn:
    """A surface-neutral request for one assistant turn.

    ``messages`` are OpenAI-style chat-template dicts (system/user/assistant with
    ``tool_calls``/tool); text completions send ``prompts`` instead (text or token ids, no
    template; one engine request each). ``tools`` are all the declared tools (``tool_choice``
    "none" hides them from the prompt). The ``*_param`` fields name the surface's own request
    fields in 400s.
    """

    messages: list[dict[str, Any]]
    prompts: list[str | list[int]] | None = None
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    response_format: GrammarSpec | None = None
    max_tokens: int | None = None
    clamp_max_tokens: bool = False  # cut max_tokens to the room left instead of a 400
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    user: str | None = None  # the agent label for stats
    cache_salt: str | None = None
    message_param: str = "messages"
    parameters_param: Callable[[int], str] = lambda i: f"tools[{i}].parameters"
    retention_s: float | None = None  # the request's hint for a tool pause (gateway/server/retention.py)
    hold_s: float | None = None  # keep the prompt's pages this long whatever the end (cache_control)
    # the rest of what sampling_params (below) reads
    n: int = 1
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    report_stop: bool = False  # find which stop string ended each choice (Anthropic reports it)
    # what the chat template reads besides the messages (``enable_thinking``, formats/reasoning.py)
    template_kwargs: dict[str, Any] | None = None

    @property
    def prompt_param(self) -> str:
        """The field a context-length error names."""
        return self.message_param

    @property
    def visible_tools(self) -> list[FunctionTool] | None:
        return self.tools if self.tools and self.tool_choice.mode != "none" else None




def sampling_params(
    turn: ChatTurn,
    prompt_len: int,
    capacity: int,
    page_size: int,
    *,
    settings: ServerSettings | None = None,
    counters: ClientCounters | None = None,
) -> SamplingParams:
    """Map a turn's fields to :class:`SamplingParams` (OpenAI defaults where a field is absent).

    ``settings`` gives the server's defaults for what a request leaves out (``temperature``:
    ``--default-temperature``, else 1.0 as OpenAI's API).
    Without ``max_tokens`` the request gets ``--default-max-tokens`` (4096 unless set; the
    server default when ``settings`` is None), or the rest of the context when it is off
    (``0``), as OpenAI's API does; either is cut to the room left. A
    ``max_tokens`` over ``--max-output-tokens`` is cut to it (off unless set). A
    ``max_tokens`` the request asked for is cut too when ``clamp_max_tokens`` (Anthropic's
    ``max_tokens`` is a required cap: Claude Code sends 32,000-64,000); else it must fit
    (OpenAI, vLLM).
    Raises ContextLengthError when the prompt leaves no room, or an OpenAI max_tokens cannot fit.
    """
    max_tokens = _max_tokens(turn, prompt_len, capacity, page_size, settings, counters)
    default_temperature = settings.default_temperature if settings is not None else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=turn.temperature if turn.temperature is not None
        else 1.0 if default_temperature is None else default_temperature,
        top_p=1.0 if turn.top_p is None else turn.top_p,
        top_k=0 if turn.top_k is None or turn.top_k < 0 else turn.top_k,
        min_p=0.0 if turn.min_p is None else turn.min_p,
        seed=turn.seed,
        presence_penalty=turn.presence_penalty or 0.0,
        frequency_penalty=turn.frequency_penalty or 0.0,
        repetition_penalty=1.0 if turn.repetition_penalty is None else turn.repetition_penalty,
        stop=tuple(turn.stop),
        stop_token_ids=tuple(turn.stop_token_ids),
        ignore_eos=turn.ignore_eos,
        logprobs=turn.logprobs,
        top_logprobs=turn.top_logprobs,
        n=turn.n,
    )


def _max_tokens(turn: ChatTurn, prompt_len: int, capacity: int, page_size: int,
                settings: ServerSettings | None, counters: ClientCounters | None) -> int:
    """The turn's output budget (see :func:`sampling_params`)."""
    # n > 1: every choice grows its own pages; leave each a share (and a page of slack).
    share = capacity if turn.n == 1 else capacity // turn.n - 2 * page_size
    max_tokens, clamp = turn.max_tokens, turn.clamp_max_tokens
    default_max_tokens = (settings or _DEFAULT_SETTINGS).default_max_tokens
    if max_tokens is None and default_max_tokens is not None:
        max_tokens, clamp = default_max_tokens, True
        if counters is not None:
            counters.add("default_max_tokens_applied")
    ceiling = (settings or _DEFAULT_SETTINGS).max_output_tokens
    if max_tokens is None:
        max_tokens = max(1, share - prompt_len)
    asked = max_tokens
    if ceiling is not None and max_tokens > ceiling:
        max_tokens = ceiling
    if clamp and prompt_len + max_tokens > share and prompt_len < share:
        max_tokens = share - prompt_len
    if max_tokens < asked and turn.max_tokens is not None and counters is not None:
        counters.add("max_tokens_clamped")  # what the request asked for was cut, once
    if prompt_len + max_tokens > capacity:
        raise ContextLengthError(prompt_len, max_tokens, capacity, param=turn.prompt_param)
    return max_tokens


@dataclass(frozen=True, slots=True)
class _Caller:
    """Who sent the turn, as the engine and retention see it."""

    tenant: str
    agent: str | None
    engine_id: str
    retention_ttl: float | None


async def _render(state: ServerState, turn: ChatTurn) -> list[list[int]]:
    """The prompt token ids: the chat template over the messages, or each raw prompt."""
    if turn.prompts is None:
        return [await state.tokenization.chat_with_tools(
            turn.messages, turn.visible_tools, True, turn.message_param, turn.template_kwargs)]
    rendered = []
    for prompt in turn.prompts:
        if isinstance(prompt, list):
            state.tokenization.check_token_ids(prompt, turn.prompt_param)
            rendered.append(prompt)
        else:
            rendered.append(await state.tokenization.text(prompt, True))
    return rendered


def render_prompts(state: ServerState, turn: ChatTurn) -> Awaitable[list[list[int]]]:
    """``turn``'s prompt token ids, rendered as :func:`open_turn` renders them (the render
    endpoints: gateway/server/openai/render.py)."""
    return _render(state, turn)


async def _grammar(state: ServerState, turn: ChatTurn, caller: _Caller,
                   prompts: list[list[int]]) -> GrammarSpec | None:
    """The turn's output grammar. Built in a worker thread when there is one to build: a cold
    schema is bounded and converted there (tools/grammar.py), never on the event loop. A chat
    prompt's end says whether the template opened a reasoning span (tools/dialect.py)."""
    if not turn.tools and turn.response_format is None:
        return None
    tail = state.tokenization.prompt_tail(prompts[0]) if turn.prompts is None else ""
    return await asyncio.to_thread(
        state.tokenization.dialect.grammar, turn.tools, turn.tool_choice, turn.response_format,
        turn.parameters_param, scope=caller.tenant, prompt_tail=tail)


def _generations(state: ServerState, turn: ChatTurn, caller: _Caller, prompts: list[list[int]],
                 grammar: GrammarSpec | None) -> list[GenerationRequest]:
    """One engine request per prompt (suffixed ids when there are several)."""
    out = []
    for i, prompt in enumerate(prompts):
        params = sampling_params(turn, len(prompt), state.capacity, state.page_size,
                                 settings=state.settings, counters=state.clients)
        request_id = caller.engine_id if len(prompts) == 1 else f"{caller.engine_id}-{i}"
        out.append(GenerationRequest(
            tuple(prompt), params, tenant=caller.tenant, agent=caller.agent,
            cache_salt=turn.cache_salt, request_id=request_id, grammar=grammar))
    return out


def _at_end(request: Request, state: ServerState, turn: ChatTurn, caller: _Caller,
            prompts: list[list[int]]) -> Callable[[TurnEnd], None]:
    """What the turn does as it ends: name each choice's stop string (when the surface reports
    it); a choice ending in tool calls keeps its whole prefix (its agent comes back with the
    results); ``hold_s`` keeps the prompt whatever the end."""

    def on_end(end: TurnEnd) -> None:
        for choice in end.choices:
            if turn.report_stop:
                # the engine's matcher names it in the final delta: the output is never
                # decoded again to find it
                choice.matched_stop = choice.engine_stop
            if choice.ended_in_calls:
                prompt = prompts[choice.index // turn.n]
                retain_tool_pause(request, caller.tenant, caller.agent, turn.cache_salt,
                                  [*prompt, *choice.token_ids], caller.retention_ttl)
        if turn.hold_s:
            retain_later(request, caller.tenant, turn.cache_salt, prompts[0], turn.hold_s)

    return on_end


def _splitters(state: ServerState, turn: ChatTurn, caller: _Caller,
               num_choices: int) -> Callable[[list[int]], OutputSplitter]:
    """Each choice's splitter, given its prompt: THE place the output parser is chosen (the
    served model's dialect: tool calls in its format, its reasoning span apart). A runaway repeat of a call ends the request there (only
    when the turn has one choice: n > 1 choices share an engine request and cannot end alone).
    """
    tools = turn.visible_tools

    def on_repeat() -> None:
        state.engine.finish_early(caller.engine_id)
        state.clients.add("repeated_calls_cut")

    guard = on_repeat if num_choices == 1 else None

    def new_splitter(prompt: list[int]) -> OutputSplitter:
        return OutputSplitter(state.tokenization.output_parser(prompt, tools, guard))

    return new_splitter


async def open_turn(request: Request, principal: Principal, turn: ChatTurn,
                    model: str | None) -> TurnStream:
    """Render, compile and admit ``turn``; engine and validation errors raise here (before any
    byte of the response), so they keep their status code."""
    state = server_state(request)
    timer = state.metrics.timer()
    state.check_model(model)
    agent = agent_of(request, turn.user)
    caller = _Caller(principal.tenant, agent, engine_request_id(request),
                     retention_ttl(request, turn.retention_s))
    note_arrival(request, principal.tenant, agent)  # back from a tool pause: learn its length
    prompts = await _render(state, turn)
    grammar = await _grammar(state, turn, caller, prompts)
    streams = await open_streams(state.engine, _generations(state, turn, caller, prompts, grammar))
    return TurnStream(streams, prompts, timer, turn.n,
                      _splitters(state, turn, caller, turn.n * len(prompts)),
                      _at_end(request, state, turn, caller, prompts))


__all__ = ["ChatTurn", "ChoiceDelta", "ChoiceOutput", "ClientDisconnected", "TurnEnd",
           "TurnStream", "open_turn", "render_prompts", "sampling_params"]
