"""One assistant turn over the engine, shared by the API surfaces that speak in turns (OpenAI
Responses, Anthropic Messages): a surface translates its wire request into a :class:`ChatTurn`
(chat-template messages, neutral tools, tool choice, sampling), opens it, and encodes the
neutral events it yields (text, call start, argument pieces, call end, then :class:`TurnEnd`)
in its own format. Prompt rendering, grammars, tenancy, ``cache_salt`` and stats are therefore
identical whichever surface a request arrives on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from prefixgate.gateway.engine.api import GenerationRequest, GrammarSpec, Usage
from prefixgate.gateway.server.auth import Principal
from prefixgate.gateway.server.generation import (
    ClientDisconnected,
    DeltaStream,
    open_streams,
    sampling_params,
    until_disconnect,
)
from prefixgate.gateway.server.metrics import RequestTimer
from prefixgate.gateway.server.retention import (
    note_arrival,
    retain_later,
    retain_tool_pause,
    retention_ttl,
)
from prefixgate.gateway.server.state import agent_of, engine_request_id, server_state
from prefixgate.gateway.server.tools import (
    CallEnd,
    Event,
    FunctionTool,
    TextPiece,
    ToolCallOutput,
    ToolChoice,
)
from prefixgate.gateway.server.tools.repeats import GuardedParser

logger = logging.getLogger("prefixgate.server")


@dataclass(slots=True)
class ChatTurn:
    """A surface-neutral request for one assistant turn.

    ``messages`` are OpenAI-style chat-template dicts (system/user/assistant with
    ``tool_calls``/tool). ``tools`` are all the declared tools (``tool_choice`` "none" hides
    them from the prompt). The ``*_param`` fields name the surface's own request fields in 400s.
    """

    messages: list[dict[str, Any]]
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
    # the rest of what gateway.server.generation.sampling_params reads
    n: int = 1
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # what the chat template reads besides the messages (``enable_thinking``, formats/reasoning.py)
    template_kwargs: dict[str, Any] | None = None

    @property
    def prompt_param(self) -> str:
        """The field a context-length error names (generation.sampling_params reads it)."""
        return self.message_param

    @property
    def visible_tools(self) -> list[FunctionTool] | None:
        return self.tools if self.tools and self.tool_choice.mode != "none" else None


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """The last event: why generation stopped, usage, the calls made, the text outside calls."""

    finish_reason: str  # the engine's: "stop" or "length"
    usage: Usage
    calls: list[ToolCallOutput]
    text: str
    matched_stop: str | None = None
    reasoning: str = ""  # the model's reasoning span, apart from ``text``


class TurnStream:
    """An opened turn (its engine request is already admitted). Iterate :meth:`events` or call
    :meth:`collect`; always :meth:`aclose` (idempotent; aborts an unfinished request)."""

    def __init__(self, stream: DeltaStream, prompt_ids: list[int], timer: RequestTimer,
                 new_parser: Callable[..., GuardedParser | None] | None = None,
                 tokenizer: Any = None, stop: list[str] | None = None,
                 on_end: Callable[[TurnEnd, list[int]], None] | None = None,
                 on_repeat: Callable[[], None] | None = None):
        self.stream = stream
        self._on_end = on_end
        self.prompt_ids = prompt_ids
        self.timer = timer

        def repeat() -> None:  # a runaway repeat of a call: end the request there
            stream.engine.finish_early(stream.request.request_id)
            if on_repeat is not None:
                on_repeat()

        # new_parser(on_repeat): Tokenization.output_parser for this turn (None: plain text)
        self._parser = new_parser(repeat) if new_parser is not None else None
        self._tokenizer = tokenizer
        self._stop = stop or []

    def _matched_stop(self, output_ids: list[int], shown: str) -> str | None:
        """Which stop string ended the output (the engine hides it; surfaces that report it,
        like Anthropic's ``stop_sequence``, find it again in the full decoded output)."""
        if not self._stop or self._tokenizer is None:
            return None
        if output_ids and output_ids[-1] in getattr(self._tokenizer, "eos_token_ids", ()):
            return None
        full = self._tokenizer.decode(output_ids)
        start = max(0, len(shown) - max(map(len, self._stop)))
        found = [(full.find(s, start), s) for s in self._stop if full.find(s, start) >= 0]
        return min(found)[1] if found else None

    async def events(self) -> AsyncIterator[Event | TurnEnd]:
        text: list[str] = []
        shown: list[str] = []
        output_ids: list[int] = []
        finish: str | None = None
        try:
            async for delta in self.stream:
                self.timer.on_delta(delta, 0)
                output_ids.extend(delta.token_ids)
                shown.append(delta.text)
                finish = delta.finish_reason or finish
                pieces: list[Event] = []
                if self._parser is None:
                    if delta.text:
                        pieces.append(TextPiece(delta.text))
                else:
                    pieces = self._parser.feed(delta.text, delta.finish_reason is not None)
                for piece in pieces:
                    if isinstance(piece, TextPiece):
                        text.append(piece.text)
                    yield piece
            usage = self.stream.usage
            if usage is None or finish is None:
                raise RuntimeError("the engine stream ended without its final usage delta")
            calls = []
            if self._parser is not None:
                finish, calls = self._parser.finish_reason(finish), self._parser.calls
            self.timer.on_finish(usage, [finish])
            joined = "".join(text)
            matched = self._matched_stop(output_ids, "".join(shown)) if finish == "stop" else None
            reasoning = "".join(self._parser.reasoning) if self._parser is not None else ""
            end = TurnEnd(finish, usage, calls, joined.strip() if calls else joined, matched,
                          reasoning)
            if self._on_end is not None:
                self._on_end(end, output_ids)
            yield end
        finally:
            self.timer.on_abort()  # no-op once finished
            await self.aclose()

    async def collect(self, request: Request) -> TurnEnd:
        """The whole turn; raises ClientDisconnected (and aborts) if the client goes first."""

        async def drain() -> TurnEnd:
            end = None
            async for event in self.events():
                if isinstance(event, TurnEnd):
                    end = event
            assert end is not None
            return end

        try:
            return await until_disconnect(request, drain())
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_turn(request: Request, principal: Principal, turn: ChatTurn,
                    model: str | None) -> TurnStream:
    """Render, compile and admit ``turn``; engine and validation errors raise here (before any
    byte of the response), so they keep their status code."""
    state = server_state(request)
    timer = state.metrics.timer()
    state.check_model(model)
    tokenization = state.tokenization
    prompt = await tokenization.chat_with_tools(
        turn.messages, turn.visible_tools, True, turn.message_param, turn.template_kwargs)
    grammar = tokenization.dialect.grammar(turn.tools, turn.tool_choice, turn.response_format,
                                           turn.parameters_param, scope=principal.tenant)
    params = sampling_params(turn, len(prompt), state.capacity, state.page_size,  # type: ignore[arg-type]
                             turn.max_tokens, False, 0,
                             settings=state.settings,
                             clamp=turn.clamp_max_tokens, counters=state.clients)
    agent = agent_of(request, turn.user)
    generation = GenerationRequest(
        tuple(prompt), params, tenant=principal.tenant, agent=agent,
        cache_salt=turn.cache_salt, request_id=engine_request_id(request), grammar=grammar)
    ttl = retention_ttl(request, turn.retention_s)
    note_arrival(request, principal.tenant, agent)  # back from a tool pause: learn its length

    def on_end(end: TurnEnd, output_ids: list[int]) -> None:
        # a session pausing on its tools comes back with this whole prefix: keep it
        if end.calls and all(c.complete for c in end.calls):
            retain_tool_pause(request, principal.tenant, agent, turn.cache_salt,
                              [*prompt, *output_ids], ttl)
        if turn.hold_s:
            retain_later(request, principal.tenant, turn.cache_salt, prompt, turn.hold_s)

    (stream,) = await open_streams(state.engine, [generation])
    return TurnStream(stream, prompt, timer, functools.partial(
                          tokenization.output_parser, prompt, turn.visible_tools),
                      tokenizer=state.engine.tokenizer, stop=turn.stop, on_end=on_end,
                      on_repeat=lambda: state.clients.add("repeated_calls_cut"))


__all__ = ["CallEnd", "ChatTurn", "ClientDisconnected", "TurnEnd", "TurnStream", "open_turn"]
