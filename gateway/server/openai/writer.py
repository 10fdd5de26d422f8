"""``/v1/chat/completions`` and ``/v1/completions`` written from the shared turn: OpenAI's
chunks (``data: {...}`` ... ``data: [DONE]``) and whole responses (the schemas/ models)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prefixgate.engine.api import EngineError, TokenLogprob, Usage
from prefixgate.gateway.http.errors import engine_error_body, error_body
from prefixgate.gateway.server.openai.schemas import (
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
    FunctionCallDelta,
    FunctionCallOut,
    LogprobEntry,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobEntry,
    UsageInfo,
)
from prefixgate.gateway.server.sse import SSE_DONE, sse_event
from prefixgate.gateway.server.tools import (
    CallArguments,
    CallStart,
    Event,
    ReasoningPiece,
    TextPiece,
)
from prefixgate.gateway.server.turn_stream import ChoiceDelta, ChoiceOutput, TurnEnd
from prefixgate.gateway.server.turn_writer import TurnWriter


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


def chat_finish_reason(finish_reason: str | None, choice: ChoiceOutput) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that called tools ended on its own."""
    if finish_reason == "stop" and choice.ended_in_calls:
        return "tool_calls"
    return finish_reason


def chat_delta(event: Event) -> ChatDelta | None:
    """One parser event as a chunk's delta (a call's end has none: its pieces were sent)."""
    if isinstance(event, TextPiece):
        return ChatDelta(content=event.text)
    if isinstance(event, ReasoningPiece):
        return ChatDelta(reasoning_content=event.text)
    if isinstance(event, CallStart):
        return ChatDelta(tool_calls=[ToolCallDelta(
            index=event.index, id=event.id, type="function",
            function=FunctionCallDelta(name=event.name, arguments=""))])
    if isinstance(event, CallArguments):
        return ChatDelta(tool_calls=[ToolCallDelta(
            index=event.index, function=FunctionCallDelta(arguments=event.text))])
    return None


def chat_message(choice: ChoiceOutput) -> AssistantMessage:
    calls = choice.calls
    reasoning = "".join(choice.reasoning) or None  # sent only when the model reasoned
    if not calls:
        return AssistantMessage(content=choice.text, reasoning_content=reasoning)
    return AssistantMessage(
        content=choice.text or None,
        tool_calls=[ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name,
                                                                   arguments=c.arguments))
                    for c in calls],
        reasoning_content=reasoning)


class _OpenAIWriter(TurnWriter):
    """What chat and text completions share: ids, the usage chunk, ``[DONE]``, errors."""

    def __init__(self, response_id: str, model: str, request_id: str, include_usage: bool):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.log_id = f"request {request_id}"
        self.request_id = request_id
        self.include_usage = include_usage
        self.exclude = None if include_usage else {"usage"}

    def usage_chunk(self, usage: Usage) -> bytes:
        raise NotImplementedError

    async def end(self, end: TurnEnd) -> list[bytes]:
        return [self.usage_chunk(end.usage), SSE_DONE] if self.include_usage else [SSE_DONE]

    def error(self, exc: EngineError | None) -> list[bytes]:
        if exc is not None:
            return [sse_event(engine_error_body(exc)), SSE_DONE]
        message = f"Internal server error (request id {self.request_id})."
        return [sse_event(error_body(message, "internal_error")), SSE_DONE]


class ChatWriter(_OpenAIWriter):
    def __init__(self, body: ChatCompletionRequest, model: str, request_id: str):
        super().__init__(f"chatcmpl-{request_id}", model, request_id, body.include_usage)
        self.body = body

    def chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_event(ChatCompletionChunk(id=self.response_id, created=self.created,
                                             model=self.model, choices=choices, usage=usage),
                         self.exclude)

    def start(self) -> list[bytes]:
        return [self.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.body.n)]

    def delta(self, delta: ChoiceDelta) -> list[bytes]:
        """One chunk per event; the delta's logprobs ride on the first, its finish on the last."""
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
        finish = chat_finish_reason(delta.finish_reason, delta.choice)
        deltas = [d for d in map(chat_delta, delta.events) if d is not None]
        if not deltas and (finish is not None or logprobs is not None):
            deltas.append(ChatDelta())  # the finish (or logprobs) still needs its chunk
        last = len(deltas) - 1
        return [self.chunk([ChatChunkChoice(index=delta.index, delta=d,
                                            logprobs=logprobs if i == 0 else None,
                                            finish_reason=finish if i == last else None)])
                for i, d in enumerate(deltas)]

    def usage_chunk(self, usage: Usage) -> bytes:
        return self.chunk([], usage_info(usage))

    async def whole(self, end: TurnEnd) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=chat_message(c),
                              logprobs=chat_logprobs(c.logprobs) if self.body.logprobs else None,
                              finish_reason=chat_finish_reason(c.finish_reason, c))
                   for c in end.choices]
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                      usage=usage_info(end.usage))


class CompletionWriter(_OpenAIWriter):
    def __init__(self, body: CompletionRequest, model: str, request_id: str):
        super().__init__(f"cmpl-{request_id}", model, request_id, body.include_usage)
        self.body = body

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return sse_event(CompletionResponse(id=self.response_id, created=self.created,
                                            model=self.model, choices=choices, usage=usage),
                         self.exclude)

    def delta(self, delta: ChoiceDelta) -> list[bytes]:
        logprobs = (completion_logprobs(delta.logprobs, delta.text_offset)
                    if delta.logprobs else None)
        return [self.chunk([CompletionChoice(index=delta.index, text=delta.text,
                                             logprobs=logprobs,
                                             finish_reason=delta.finish_reason)])]

    def usage_chunk(self, usage: Usage) -> bytes:
        return self.chunk([], usage_info(usage))

    async def whole(self, end: TurnEnd) -> CompletionResponse:
        with_logprobs = self.body.logprobs is not None
        choices = [CompletionChoice(index=c.index, text="".join(c.shown),
                                    logprobs=completion_logprobs(c.logprobs, 0) if with_logprobs
                                    else None,
                                    finish_reason=c.finish_reason)
                   for c in end.choices]
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                  usage=usage_info(end.usage))
