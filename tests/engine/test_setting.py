"""engine/setting.py and gateway/flags.py on a config of their own: one field is a flag, an
environment variable, a default and a docs row, with nothing else to write."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from prefixgate.engine.setting import build, knobs, nested, positive_int, setting
from prefixgate.gateway import flags


@dataclass(frozen=True, slots=True)
class Inner:
    size: int = setting(8, flag="--inner-size", type=positive_int, group="inner", help="(default {default})")


@dataclass(frozen=True, slots=True)
class Toy:
    count: int = setting(3, flag="--count", type=positive_int, group="g", help="n (default {default})")
    fast: bool = setting(True, flag="--fast", switch=True, group="g", help="x (default {default})")
    mode: str | None = setting(None, flag="--mode", choices=("auto", "a", "b"), none_word="auto",
                               group="g", help="m (default {default})")
    tags: tuple[str, ...] = setting((), flag="--tag", repeatable=True, group="g", help="t")
    gb: float | None = setting(None, flag="--memory", type=float, exclusive="pool", group="g", help="gb")
    pages: int | None = setting(None, flag="--pages", type=int, exclusive="pool", group="g", help="p")
    token: str | None = setting(None, flag="--token", secret=True, group="g", help="s")
    library_only: int = 5
    inner: Inner = nested(Inner)


def _parse(argv: list[str], env: dict[str, str]) -> Toy:
    parser = argparse.ArgumentParser()
    flags.add_flags(parser, (Toy,))
    return build(Toy, flags.resolve(parser.parse_args(argv), parser, (Toy,), env))


def test_defaults_are_the_fields_in_command_line_words():
    assert flags.defaults((Toy,)) == {"count": 3, "fast": "on", "mode": "auto", "tags": [],
                                      "gb": None, "pages": None, "token": None, "size": 8}
    assert _parse([], {}) == Toy()


def test_flags_and_variables_land_in_the_field_of_the_same_name():
    toy = _parse(["--count", "4", "--fast", "off", "--tag", "x", "--tag", "y", "--memory", "2"],
                 {"PREFIXGATE_MODE": "b", "PREFIXGATE_INNER_SIZE": "16", "PREFIXGATE_COUNT": "9"})
    assert (toy.count, toy.fast, toy.mode, toy.tags, toy.gb, toy.inner.size) == (
        4, False, "b", ("x", "y"), 2.0, 16)
    assert _parse([], {"PREFIXGATE_TAG": "p, q", "PREFIXGATE_FAST": "no"}).tags == ("p", "q")
    assert _parse(["--mode", "auto"], {}).mode is None


def test_bad_values_and_exclusive_pairs_are_usage_errors(capsys):
    for argv, env, says in ((["--count", "0"], {}, "--count"),
                            ([], {"PREFIXGATE_COUNT": "0"}, "PREFIXGATE_COUNT"),
                            ([], {"PREFIXGATE_MODE": "c"}, "choose from"),
                            (["--memory", "1", "--pages", "2"], {}, "not allowed with"),
                            (["--memory", "1"], {"PREFIXGATE_PAGES": "2"}, "give one of")):
        with pytest.raises(SystemExit):
            _parse(argv, env)
        assert says in capsys.readouterr().err


def test_help_reads_the_default_and_secrets_stay_out_of_repr():
    parser = argparse.ArgumentParser()
    flags.add_flags(parser, (Toy,))
    text = " ".join(parser.format_help().split())
    assert "n (default 3)" in text and "x (default on)" in text and "(default 8)" in text
    assert "hunter2" not in repr(Toy(token="hunter2"))
    assert [k.name for k in knobs(Toy)] == ["count", "fast", "mode", "tags", "gb", "pages",
                                            "token", "size"]


def test_two_configs_may_share_a_field_only_spelled_alike():
    @dataclass(frozen=True)
    class Other:
        count: int = setting(3, flag="--number", type=int, group="g", help="n")

    with pytest.raises(ValueError, match="disagrees"):
        flags.command_knobs((Toy, Other))
