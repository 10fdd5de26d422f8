"""OpenAI-compatible endpoints: chat and text completions, models, tokenize / detokenize.

Routes stay thin: validate (pydantic), authenticate (tenant), tokenise, open the engine
streams (errors surface here, before any byte is sent), then either stream SSE chunks or
collect one JSON response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from prefixgate.gateway.engine.api import Delta, EngineError, GenerationRequest, TokenLogprob, Usage
from prefixgate.gateway.server.auth import Principal, authenticate
from prefixgate.gateway.server.errors import engine_error_body, error_body, request_id_of
from prefixgate.gateway.server.generation import (
    ClientDisconnected,
    DeltaStream,
    merge_streams,
    open_streams,
    sampling_params,
    sum_usage,
    until_disconnect,
)
from prefixgate.gateway.server.metrics import RequestTimer
from prefixgate.gateway.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCallDelta,
    FunctionCallOut,
    LogprobEntry,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobEntry,
    UsageInfo,
    template_tools,
)
from prefixgate.gateway.server.retention import note_arrival, retain_tool_pause, retention_ttl
from prefixgate.gateway.server.sse import SSE_DONE, SSEResponse, sse_event
from prefixgate.gateway.server.state import ServerState, agent_of, engine_request_id, server_state
from prefixgate.gateway.server.tools import (
    CallArguments,
    CallStart,
    ReasoningPiece,
    TextPiece,
    ToolCallOutput,
)
from prefixgate.gateway.server.tools.repeats import GuardedParser

logger = logging.getLogger("prefixgate.server")
router = APIRouter()

# 499 (nginx's "client closed request"): logged, never seen by the client, who is gone.
CLIENT_CLOSED_REQUEST = 499


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            LogprobEntry(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token.encode()),
                top_logprobs=[
                    TopLogprobEntry(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                    for t in lp.top
                ],
            )
            for lp in logprobs
        ]
    )


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far (non-streaming responses and legacy logprobs)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_chars: int = 0  # text offset for completion logprobs
    parser: GuardedParser | None = None  # a response that may hold tool calls
    token_ids: list[int] = field(default_factory=list)

    @property
    def final_finish_reason(self) -> str | None:
        """The engine's finish reason, or "stop" for a turn cut at a repeated call."""
        return self.parser.finish_reason(self.finish_reason) if self.parser else self.finish_reason

    def add(self, delta: Delta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def completion_logprobs(logprobs: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """The legacy completions format; ``text_offset`` is where these tokens start in the text."""
    out = CompletionLogprobs()
    for lp in logprobs:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t.token: t.logprob for t in lp.top})
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


async def collect(
    streams: Sequence[DeltaStream], timer: RequestTimer, choices_per_stream: int,
    new_parser: Callable[[], GuardedParser] | None = None,
) -> tuple[dict[int, ChoiceState], Usage]:
    """Drain every stream into per-choice state; returns the choices and the summed usage.
    ``new_parser``: parse each choice's tool calls as it grows (a repeat ends it early)."""
    choices: dict[int, ChoiceState] = {}
    merged = merge_streams(streams)
    try:
        async for stream_index, delta in merged:
            index = stream_index * choices_per_stream + delta.index
            timer.on_delta(delta, index)
            choice = choices.setdefault(index, ChoiceState())
            choice.add(delta)
            if new_parser is not None:
                if choice.parser is None:
                    choice.parser = new_parser()
                choice.parser.feed(delta.text, delta.finish_reason is not None)
    finally:
        await merged.aclose()
    usages = [s.usage for s in streams]
    if any(u is None for u in usages):
        raise RuntimeError("an engine stream ended without its final usage delta")
    usage = sum_usage(usages)  # type: ignore[arg-type]
    timer.on_finish(usage, (c.finish_reason for c in choices.values()))
    return choices, usage


class _EventMaker:
    """Builds the SSE events of one streamed response (chat and completions differ)."""

    def __init__(self, response_id: str, model: str, include_usage: bool):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.exclude = None if include_usage else {"usage"}

    def __call__(self, index: int, delta: Delta, state: ChoiceState) -> bytes:
        raise NotImplementedError

    def usage_event(self, usage: Usage) -> bytes:
        raise NotImplementedError


def chat_finish_reason(finish_reason: str | None, calls: list[ToolCallOutput]) -> str | None:
    """OpenAI's ``tool_calls`` when a response that called tools ended on its own."""
    if finish_reason == "stop" and calls and all(c.complete for c in calls):
        return "tool_calls"
    return finish_reason


def tool_calls_out(calls: list[ToolCallOutput]) -> list[ToolCallOut] | None:
    if not calls:
        return None
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]


def chat_message(choice: ChoiceState, parse_tools: bool
                 ) -> tuple[AssistantMessage, list[ToolCallOutput]]:
    text = "".join(choice.text)
    if not parse_tools or choice.parser is None:
        return AssistantMessage(content=text), []
    calls = choice.parser.calls
    reasoning = "".join(choice.parser.reasoning) or None
    if not calls:
        if reasoning is None:
            return AssistantMessage(content=text), []
        return AssistantMessage(content="".join(choice.parser.text),
                                reasoning_content=reasoning), []
    content = "".join(choice.parser.text).strip()
    return AssistantMessage(content=content or None, tool_calls=tool_calls_out(calls),
                            reasoning_content=reasoning), calls


class _ChatEvents(_EventMaker):
    def __init__(self, response_id: str, model: str, include_usage: bool,
                 new_parser: Callable[[], GuardedParser | None] | None = None):
        super().__init__(response_id, model, include_usage)
        self.parse_tools = new_parser is not None
        self.new_parser = new_parser

    def chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=self.response_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            ),
            self.exclude,
        )

    def role(self, index: int) -> bytes:
        return self.chunk(
            [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]
        )

    def __call__(self, index: int, delta: Delta, state: ChoiceState) -> bytes:
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
        if not self.parse_tools:
            return self.chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=delta.text or None),
                                               logprobs=logprobs, finish_reason=delta.finish_reason)])
        if state.parser is None:
            assert self.new_parser is not None
            state.parser = self.new_parser()
        assert state.parser is not None
        events = state.parser.feed(delta.text, delta.finish_reason is not None)
        deltas: list[ChatDelta] = []
        for event in events:
            if isinstance(event, TextPiece):
                deltas.append(ChatDelta(content=event.text))
            elif isinstance(event, ReasoningPiece):
                deltas.append(ChatDelta(reasoning_content=event.text))
            elif isinstance(event, CallStart):
                deltas.append(ChatDelta(tool_calls=[ToolCallDelta(
                    index=event.index, id=event.id, type="function",
                    function=FunctionCallDelta(name=event.name, arguments=""))]))
            elif isinstance(event, CallArguments):
                deltas.append(ChatDelta(tool_calls=[ToolCallDelta(
                    index=event.index, function=FunctionCallDelta(arguments=event.text))]))
        finish = chat_finish_reason(state.parser.finish_reason(delta.finish_reason),
                                    state.parser.calls)
        if not deltas and (finish is not None or logprobs is not None):
            deltas.append(ChatDelta())  # the finish (or logprobs) still needs its chunk
        out = []
        for i, chat_delta in enumerate(deltas):
            last = i == len(deltas) - 1
            out.append(self.chunk([ChatChunkChoice(
                index=index, delta=chat_delta, logprobs=logprobs if i == 0 else None,
                finish_reason=finish if last else None)]))
        return b"".join(out)

    def usage_event(self, usage: Usage) -> bytes:
        return self.chunk([], usage_info(usage))


class _CompletionEvents(_EventMaker):
    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        response = CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )
        return sse_event(response, self.exclude)

    def __call__(self, index: int, delta: Delta, state: ChoiceState) -> bytes:
        logprobs = completion_logprobs(delta.logprobs, state.num_chars) if delta.logprobs else None
        return self.chunk(
            [
                CompletionChoice(
                    index=index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                )
            ]
        )

    def usage_event(self, usage: Usage) -> bytes:
        return self.chunk([], usage_info(usage))


async def stream_events(
    streams: Sequence[DeltaStream],
    timer: RequestTimer,
    choices_per_stream: int,
    include_usage: bool,
    request_id: str,
    opening: Sequence[bytes],
    events: _EventMaker,
    after: Callable[[dict[int, ChoiceState]], None] | None = None,
) -> AsyncIterator[bytes]:
    """Shared SSE loop: opening events, one event per delta, the usage event, ``[DONE]``.

    Errors after the first byte cannot change the status code: they are sent as an
    ``{"error": ...}`` event before ``[DONE]``, as vLLM and OpenAI do.
    """
    merged = merge_streams(streams)
    choices: dict[int, ChoiceState] = {}
    try:
        for event in opening:
            yield event
        async for stream_index, delta in merged:
            index = stream_index * choices_per_stream + delta.index
            timer.on_delta(delta, index)
            state = choices.setdefault(index, ChoiceState())
            # A delta whose bytes do not yet form a character carries no text: skip it.
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                event = events(index, delta, state)
                if event:  # a tool-call parser may hold text back (a possible tag start)
                    yield event
            state.add(delta)
            state.num_chars += len(delta.text)
        usages = [s.usage for s in streams]
        if any(u is None for u in usages):
            raise RuntimeError("an engine stream ended without its final usage delta")
        usage = sum_usage(usages)  # type: ignore[arg-type]
        timer.on_finish(usage, (c.finish_reason for c in choices.values()))
        if after is not None:
            after(choices)
        if include_usage:
            yield events.usage_event(usage)
        yield SSE_DONE
    except EngineError as exc:
        logger.warning("request %s failed mid-stream: %s", request_id, exc.message)
        yield sse_event(engine_error_body(exc))
        yield SSE_DONE
    except Exception:
        logger.exception("request %s: internal error mid-stream", request_id)
        yield sse_event(
            error_body(f"Internal server error (request id {request_id}).", "internal_error")
        )
        yield SSE_DONE
    finally:
        timer.on_abort()  # no-op when it finished
        await merged.aclose()
        for stream in streams:  # the merge may never have started; close (abort) directly too
            await stream.aclose()


async def _respond(
    request: Request,
    streams: list[DeltaStream],
    timer: RequestTimer,
    n: int,
    build: Callable[[dict[int, ChoiceState], Usage], BaseModel],
    new_parser: Callable[[], GuardedParser] | None = None,
) -> Response | BaseModel:
    """Collect a non-streaming response, giving up (and aborting) if the client disconnects."""
    try:
        choices, usage = await until_disconnect(request, collect(streams, timer, n, new_parser))
    except ClientDisconnected:
        timer.on_abort()
        logger.info("request %s: client disconnected before the response", request_id_of(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        for stream in streams:
            await stream.aclose()
    return build(choices, usage)


def repeat_guard(state: ServerState, engine_id: str, n: int) -> Callable[[], None] | None:
    """What to do at a runaway repeat of a call (tools/repeats.py): end the request there.
    None for n > 1: the choices share one engine request, so one cannot end alone."""
    if n != 1:
        return None

    def on_repeat() -> None:
        state.engine.finish_early(engine_id)
        state.clients.add("repeated_calls_cut")

    return on_repeat


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: Principal = Depends(authenticate)
):
    state = server_state(request)
    timer = state.metrics.timer()
    state.check_model(body.model)
    agent = agent_of(request, body.user)
    note_arrival(request, principal.tenant, agent)  # back from a tool pause: learn its length
    tokenization = state.tokenization
    prompt = await tokenization.chat_with_tools(
        body.template_messages(), body.template_tools(), True,
        template_kwargs=body.template_kwargs())
    grammar = body.output_grammar(scope=principal.tenant, dialect=tokenization.dialect)
    params = sampling_params(
        body,
        len(prompt),
        state.capacity,
        state.page_size,
        body.requested_max_tokens,
        body.logprobs,
        body.top_logprobs or 0,
        settings=state.settings,
        counters=state.clients,
    )
    request_id = request.state.request_id
    engine_id = engine_request_id(request)
    generation = GenerationRequest(
        tuple(prompt),
        params,
        tenant=principal.tenant,
        agent=agent,
        cache_salt=body.cache_salt,
        request_id=engine_id,
        grammar=grammar,
    )
    streams = await open_streams(state.engine, [generation])
    response_id = f"chatcmpl-{request_id}"
    guard = repeat_guard(state, engine_id, body.n)
    tools = body.template_tools()
    # the output is parsed when it may hold calls or a reasoning span (the model's dialect)
    parse_tools = tokenization.dialect.parses(tools)

    def new_parser() -> GuardedParser | None:
        return tokenization.output_parser(prompt, tools, guard)

    ttl = retention_ttl(request, body.retention_seconds) if body.expects_tool_calls else 0.0

    def retain_tool_pauses(choices: dict[int, ChoiceState]) -> None:
        # a choice that ended in tool calls: its agent returns with the results and this prefix
        for c in choices.values():
            calls = c.parser.calls if c.parser is not None else []
            if chat_finish_reason(c.final_finish_reason, calls) == "tool_calls":
                retain_tool_pause(request, principal.tenant, agent, body.cache_salt,
                                  [*prompt, *c.token_ids], ttl)

    if body.stream:
        events = _ChatEvents(response_id, state.model_name, body.include_usage,
                             new_parser if parse_tools else None)
        opening = [events.role(i) for i in range(body.n)]
        return SSEResponse(
            stream_events(streams, timer, body.n, body.include_usage, request_id, opening, events,
                          retain_tool_pauses if body.expects_tool_calls else None)
        )

    def build(choices: dict[int, ChoiceState], usage: Usage) -> ChatCompletionResponse:
        out = []
        for i, c in sorted(choices.items()):
            message, calls = chat_message(c, parse_tools)
            out.append(ChatChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(c.logprobs) if body.logprobs else None,
                finish_reason=chat_finish_reason(c.final_finish_reason, calls),
            ))
        if body.expects_tool_calls:
            retain_tool_pauses(choices)
        return ChatCompletionResponse(
            id=response_id, model=state.model_name, choices=out, usage=usage_info(usage))

    return await _respond(request, streams, timer, body.n, build,
                          new_parser if parse_tools else None)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, principal: Principal = Depends(authenticate)
):
    state = server_state(request)
    timer = state.metrics.timer()
    state.check_model(body.model)
    agent = agent_of(request, body.user)
    capacity = state.capacity
    request_id = request.state.request_id
    engine_id = engine_request_id(request)
    generations = []
    for i, prompt in enumerate(body.prompt):
        if isinstance(prompt, list):
            state.tokenization.check_token_ids(prompt, "prompt")
            token_ids = prompt
        else:
            token_ids = await state.tokenization.text(prompt, True)
        params = sampling_params(
            body,
            len(token_ids),
            capacity,
            state.page_size,
            body.max_tokens,
            body.logprobs is not None,
            body.logprobs or 0,
            settings=state.settings,
            counters=state.clients,
        )
        generations.append(
            GenerationRequest(
                tuple(token_ids),
                params,
                tenant=principal.tenant,
                agent=agent,
                cache_salt=body.cache_salt,
                request_id=engine_id if len(body.prompt) == 1 else f"{engine_id}-{i}",
            )
        )
    streams = await open_streams(state.engine, generations)
    response_id = f"cmpl-{request_id}"
    if body.stream:
        events = _CompletionEvents(response_id, state.model_name, body.include_usage)
        return SSEResponse(
            stream_events(streams, timer, body.n, body.include_usage, request_id, (), events)
        )

    def build(choices: dict[int, ChoiceState], usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=response_id,
            model=state.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text="".join(c.text),
                    logprobs=completion_logprobs(c.logprobs, 0)
                    if body.logprobs is not None
                    else None,
                    finish_reason=c.finish_reason,
                )
                for i, c in sorted(choices.items())
            ],
            usage=usage_info(usage),
        )

    return await _respond(request, streams, timer, body.n, build)


@router.get("/v1/models")
async def list_models(request: Request, _: Principal = Depends(authenticate)) -> ModelList:
    state: ServerState = server_state(request)
    return ModelList(
        data=[
            ModelCard(
                id=state.model_name, created=state.created, max_model_len=state.engine.max_model_len,
                # stand-in engines (tests) may not say
                dtype=getattr(state.engine, "dtype", None),
                kv_dtype=getattr(state.engine, "kv_dtype", None),
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
