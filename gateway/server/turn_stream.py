"""An opened turn's engine streams as parsed, per-choice deltas, then one :class:`TurnEnd`.

Every API surface reads a turn here: each engine delta of each choice is split into neutral
events (text, a call's start, pieces of its arguments, its end) by :class:`OutputSplitter`, the
one place the tool-call parser runs; the turn ends with the summed usage and each choice's
final state (finish reason, calls, text, matched stop string). A surface only encodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from prefixgate.engine.api import Delta, TokenLogprob, Usage
from prefixgate.gateway.http.disconnect import until_disconnect
from prefixgate.gateway.server.generation import DeltaStream, merge_streams, sum_usage
from prefixgate.gateway.server.metrics import RequestTimer
from prefixgate.gateway.server.tools import Event, ReasoningPiece, TextPiece, ToolCallOutput
from prefixgate.gateway.server.tools.repeats import GuardedParser


class OutputSplitter:
    """The one place a choice's generated text becomes events: plain text when the turn's output
    is not parsed, else its parser (tools/parser.py behind the repeat guard, tools/repeats.py;
    built by ``turn.py`` ``_splitters``)."""

    def __init__(self, parser: GuardedParser | None = None):
        self._parser = parser

    def feed(self, text: str, final: bool) -> list[Event]:
        """The events of ``text`` (``final``: the output ended; flush what is held)."""
        if self._parser is None:
            return [TextPiece(text)] if text else []
        return self._parser.feed(text, final)

    @property
    def calls(self) -> list[ToolCallOutput]:
        return self._parser.calls if self._parser is not None else []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The engine's reason, or "stop" for a turn cut at a repeated call."""
        return self._parser.finish_reason(engine_reason) if self._parser else engine_reason


@dataclass(slots=True)
class ChoiceOutput:
    """What one choice has produced so far (all of it once the turn has ended)."""

    index: int
    splitter: OutputSplitter
    shown: list[str] = field(default_factory=list)  # every delta's text, as the engine sent it
    content: list[str] = field(default_factory=list)  # the text outside tool calls
    reasoning: list[str] = field(default_factory=list)  # the model's reasoning span
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    engine_finish: str | None = None
    num_chars: int = 0  # characters shown so far (completions' logprob text offsets)
    engine_stop: str | None = None  # the stop string that ended it, as its final delta says
    matched_stop: str | None = None  # set at the end when the surface reports it

    @property
    def finish_reason(self) -> str | None:
        return self.splitter.finish_reason(self.engine_finish)

    @property
    def calls(self) -> list[ToolCallOutput]:
        return self.splitter.calls

    @property
    def text(self) -> str:
        """The answer outside calls (trimmed around calls)."""
        joined = "".join(self.content)
        return joined.strip() if self.calls else joined

    @property
    def ended_in_calls(self) -> bool:
        """The choice stopped on its own after whole calls: its agent runs them and comes back."""
        calls = self.calls
        return self.finish_reason == "stop" and bool(calls) and all(c.complete for c in calls)

    def add(self, delta: Delta) -> ChoiceDelta:
        """Split ``delta`` and take it in; returns it as a :class:`ChoiceDelta`."""
        events = self.splitter.feed(delta.text, delta.finish_reason is not None)
        parsed = ChoiceDelta(self.index, delta.text, events, delta.logprobs,
                             self.splitter.finish_reason(delta.finish_reason), self.num_chars, self)
        for event in events:
            if isinstance(event, TextPiece):
                self.content.append(event.text)
            elif isinstance(event, ReasoningPiece):
                self.reasoning.append(event.text)
        self.shown.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.num_chars += len(delta.text)
        if delta.finish_reason is not None:
            self.engine_finish = delta.finish_reason
            self.engine_stop = delta.matched_stop
        return parsed


@dataclass(slots=True)  # not frozen: one per delta, and a frozen init costs more
class ChoiceDelta:
    """One engine delta of one choice, split into events."""

    index: int
    text: str  # as the engine sent it
    events: list[Event]
    logprobs: Sequence[TokenLogprob] | None
    finish_reason: str | None  # the choice's final reason when this delta ends it
    text_offset: int  # characters of this choice shown before this delta
    choice: ChoiceOutput  # the choice so far (its calls, for a finish reason)


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """The last item of a turn: the summed usage and every choice, by index. The single-choice
    views (``finish_reason``, ``calls``, ``text``, ``matched_stop``, ``reasoning``) read
    choice 0."""

    usage: Usage
    choices: list[ChoiceOutput]

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason or "stop"

    @property
    def calls(self) -> list[ToolCallOutput]:
        return self.choices[0].calls

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def matched_stop(self) -> str | None:
        return self.choices[0].matched_stop

    @property
    def reasoning(self) -> str:
        """The model's reasoning span, apart from ``text``."""
        return "".join(self.choices[0].reasoning)


class TurnStream:
    """An opened turn (its engine requests are admitted). Iterate :meth:`deltas` or call
    :meth:`collect`; always :meth:`aclose` (idempotent; aborts unfinished requests).

    Choice ``i`` of prompt ``p`` is index ``p * choices_per_stream + i`` (text completions
    send several prompts, one engine request each); ``new_splitter(prompt_ids)`` makes each
    choice's :class:`OutputSplitter`.
    """

    def __init__(self, streams: Sequence[DeltaStream], prompts: Sequence[list[int]],
                 timer: RequestTimer, choices_per_stream: int,
                 new_splitter: Callable[[list[int]], OutputSplitter],
                 on_end: Callable[[TurnEnd], None] = lambda end: None):
        self.streams = list(streams)
        self.prompts = list(prompts)
        self.timer = timer
        self._per_stream = choices_per_stream
        self._new_splitter = new_splitter
        self._on_end = on_end
        self._choices: dict[int, ChoiceOutput] = {}

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    def _choice(self, index: int) -> ChoiceOutput:
        if index not in self._choices:
            prompt = self.prompts[index // self._per_stream]
            self._choices[index] = ChoiceOutput(index, self._new_splitter(prompt))
        return self._choices[index]

    async def deltas(self) -> AsyncIterator[ChoiceDelta | TurnEnd]:
        """Each delta that shows something (text, logprobs or a finish), then the TurnEnd."""
        merged = merge_streams(self.streams)
        try:
            async for stream_index, delta in merged:
                index = stream_index * self._per_stream + delta.index
                self.timer.on_delta(delta, index)
                parsed = self._choice(index).add(delta)
                # A delta whose bytes do not yet form a character carries no text: skip it.
                if delta.text or delta.finish_reason is not None or delta.logprobs:
                    yield parsed
            yield self._end()
        finally:
            await merged.aclose()
            await self.aclose()

    def _end(self) -> TurnEnd:
        usages = [s.usage for s in self.streams if s.usage is not None]
        if len(usages) != len(self.streams):
            raise RuntimeError("an engine stream ended without its final usage delta")
        choices = [self._choices[i] for i in sorted(self._choices)]
        usage = sum_usage(usages)
        self.timer.on_finish(usage, (c.finish_reason for c in choices))
        end = TurnEnd(usage, choices)
        self._on_end(end)
        return end

    async def collect(self, request: Request) -> TurnEnd:
        """The whole turn; raises ClientDisconnected (and aborts) if the client goes first."""

        async def drain() -> TurnEnd:
            end = None
            async for item in self.deltas():
                if isinstance(item, TurnEnd):
                    end = item
            assert end is not None, "deltas() ends with a TurnEnd or raises"
            return end

        try:
            return await until_disconnect(request, drain())
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        self.timer.on_abort()  # no-op once finished
        for stream in self.streams:  # the merge may never have started: close (abort) here too
            await stream.aclose()
