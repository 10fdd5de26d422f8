import pytest

from prefixgate.engine.stop_strings import StopStringMatcher


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


def test_the_matcher_names_the_stop_that_matched():
    m = StopStringMatcher(["xyz", "b"])
    assert m.matched is None
    assert m.feed("aaxy") == ("aa", False) and m.matched is None
    assert m.feed("zb") == ("", True) and m.matched == "xyz"  # the earliest occurrence wins
    m = StopStringMatcher(["b", "xyz"])
    m.feed("aaxyzb")
    assert m.matched == "xyz"  # whatever the order they are listed in


def test_of_stops_starting_at_one_place_the_shortest_is_named():
    # "ab" completed first (it is a prefix of "abc"); both are found in one piece of text
    assert run(["abc", "ab"], ["x", "abc"]) == ("x", True)
    m = StopStringMatcher(["abc", "ab"])
    m.feed("xabc")
    assert m.matched == "ab"


def test_no_match_names_nothing():
    m = StopStringMatcher(["END"])
    assert m.feed("no stop here, EN") == ("no stop here, ", False)
    assert m.flush() == "EN" and m.matched is None
