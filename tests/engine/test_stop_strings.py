import pytest

from prefixgate.gateway.engine.stop_strings import StopStringMatcher


def run(stop, pieces):
    m = StopStringMatcher(stop)
    shown = []
    for piece in pieces:
        out, stopped = m.feed(piece)
        shown.append(out)
        if stopped:
            return "".join(shown), True
    return "".join(shown) + m.flush(), False


@pytest.mark.parametrize(
    "pieces",
    [["Hello ", "wor", "ld", "END", "more"], ["Hello world", "E", "N", "Dmore"], ["Hello worldEN", "D"]],
)
def test_stop_across_token_boundaries_is_not_shown(pieces):
    assert run(["END"], pieces) == ("Hello world", True)


def test_no_match_emits_everything_after_flush():
    assert run(["END"], ["a", "EN", "b"]) == ("aENb", False)


def test_earliest_of_several_stops_wins():
    assert run(["xyz", "b"], ["aaxy", "zb"]) == ("aa", True)


def test_no_stops_passes_through_immediately():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
