"""A turn's end without a model (gateway/server/turn_stream.py, and turn.py's end hook): the
stop string a surface reports (Anthropic's ``stop_sequence``) is the one the engine's matcher
named in the choice's final delta; the output is never decoded again to find it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefixgate.engine.api import Delta, Usage
from prefixgate.gateway.server.turn import ChatTurn, _at_end, _Caller
from prefixgate.gateway.server.turn_stream import ChoiceOutput, OutputSplitter, TurnEnd


class NoDecode:
    """A tokenizer that fails the test if anything decodes the output again."""

    eos_token_ids = (2,)

    def decode(self, *args, **kwargs):
        raise AssertionError("the whole output was decoded again to find its stop string")


def end_turn(turn: ChatTurn, deltas: list[Delta]) -> ChoiceOutput:
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=NoDecode()))
    choice = ChoiceOutput(0, OutputSplitter())
    for delta in deltas:
        choice.add(delta)
    on_end = _at_end(None, state, turn, _Caller("default", None, "req-1", None), [[1, 2, 3]])
    on_end(TurnEnd(Usage(3, len(deltas), 0), [choice]))
    return choice


def test_the_reported_stop_is_the_engines():
    # "xab" with stops "b" and "ab": the engine's matcher cut at "ab" (the earliest)
    turn = ChatTurn(messages=[], stop=["b", "ab"], report_stop=True)
    choice = end_turn(turn, [Delta(0, (5,), "x"), Delta(0, (6,), "", "stop", matched_stop="ab")])
    assert (choice.finish_reason, choice.matched_stop) == ("stop", "ab")


@pytest.mark.parametrize(("finish", "engine_stop", "report"), [
    ("stop", None, True),  # EOS, a stop token or a grammar's end
    ("length", None, True),
    ("stop", "ab", False),  # a surface that does not report it (OpenAI)
])
def test_no_stop_is_reported_unless_the_engine_names_one(finish, engine_stop, report):
    turn = ChatTurn(messages=[], stop=["b", "ab"], report_stop=report)
    choice = end_turn(turn, [Delta(0, (5,), "xab"),
                             Delta(0, (6,), "", finish, matched_stop=engine_stop)])
    assert choice.matched_stop is None
