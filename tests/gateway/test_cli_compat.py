"""The generated parser keeps the public CLI of before issue 39 (one source for every setting).

``cli_flags_before_39.json`` was captured from the hand-written parser just before it was
replaced: for every flag of ``serve`` and ``route``, its environment variable, the choices, a
sample value and the config fields that value changed (as ``repr``), the values the parser
rejected, and every config field's default. The generated parser must read each flag and
variable into the same fields with the same values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from prefixgate.gateway import cli

PARSER = cli.build_parser()  # parsing leaves it as it was: one for the module
BEFORE = json.loads((Path(__file__).parent / "cli_flags_before_39.json").read_text())
# Widened on purpose: every on/off switch takes the same spellings (on/off, true/false,
# yes/no, 1/0); these two took only "on" and "off" before.
WIDENED = {("serve", "--parse-special-tokens"): {"0", "1"},
           ("route", "--parse-special-tokens"): {"0", "1"},
           ("route", "--metrics-public"): {"0", "1"}}
# Flags added since (each one field of a typed config): its variable, and the field it fills
# with its default and with "off"
ADDED = {
    "serve": {"--native-decode-step": ("PREFIXGATE_NATIVE_DECODE_STEP",
                                       "engine.native_decode_step", "True", "False")},
    "route": {},
}


def _fields(record: object, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for field in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, field.name)
        if dataclasses.is_dataclass(value):
            out.update(_fields(value, f"{prefix}{field.name}."))
        elif field.name == "api_keys_file":
            continue  # new: the keys file is kept beside the keys it added
        else:
            out[prefix + field.name] = repr(dict(value) if hasattr(value, "items") else value)
    return out


def _state(command: str, argv: list[str], env: dict[str, str], keys_file: Path) -> dict[str, str]:
    argv = [a.replace("{keys_file}", str(keys_file)) for a in argv]
    env = {k: v.replace("{keys_file}", str(keys_file)) for k, v in env.items()}
    parser = PARSER
    values = cli.resolve(parser.parse_args([command, *argv]), parser, env, command)
    if command == "serve":
        engine, settings = cli.configs(values)
        return {**_fields(engine, "engine."), **_fields(settings, "server.")}
    return _fields(cli.route_settings(values), "router.")


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("fk ftenant\n")
    return path


@pytest.mark.parametrize("command", ["serve", "route"])
def test_the_same_flags_and_variables(command):
    knobs = cli.command_knobs(command)
    assert {k.spec.flag for k in knobs} == set(BEFORE[command]["flags"]) | set(ADDED[command])
    for knob in knobs:
        if knob.spec.flag in ADDED[command]:
            assert knob.spec.env == ADDED[command][knob.spec.flag][0]
            continue
        before = BEFORE[command]["flags"][knob.spec.flag]
        assert knob.spec.env == before["env"]
        assert knob.spec.repeatable == before["append"], knob.spec.flag
        if before["choices"] is not None and (command, knob.spec.flag) not in WIDENED:
            assert [str(c) for c in knob.spec.choices or ()] == before["choices"], knob.spec.flag


@pytest.mark.parametrize("command", ["serve", "route"])
def test_no_flag_gives_the_same_configs(command, keys_file):
    before = BEFORE[command]
    added = {field: default for _, field, default, _ in ADDED[command].values()}
    assert _state(command, before["base_argv"], {}, keys_file) == {**before["defaults"], **added}


@pytest.mark.parametrize("command, flag", [(c, f) for c in ADDED for f in ADDED[c]])
def test_each_added_flag_and_its_variable_set_their_field(command, flag, keys_file):
    env_name, field, _, off = ADDED[command][flag]
    base_argv = BEFORE[command]["base_argv"]
    defaults = _state(command, base_argv, {}, keys_file)
    for argv, env in (([*base_argv, flag, "off"], {}), (base_argv, {env_name: "off"})):
        got = _state(command, argv, env, keys_file)
        assert {k: v for k, v in got.items() if defaults.get(k) != v} == {field: off}


@pytest.mark.parametrize("command, flag", [(c, f) for c in ("serve", "route")
                                          for f in BEFORE[c]["flags"]])
def test_each_flag_and_its_variable_set_the_same_fields(command, flag, keys_file):
    before = BEFORE[command]
    entry = before["flags"][flag]
    base_argv = [] if flag == "--replica" else before["base_argv"]
    defaults = before["defaults"] if flag == "--replica" else _state(command, base_argv, {}, keys_file)
    for argv, env in (([*base_argv, flag, entry["value"]], {}),
                      (base_argv, {entry["env"]: entry["value"]})):
        got = _state(command, argv, env, keys_file)
        changed = {k: v for k, v in got.items() if defaults.get(k) != v}
        assert changed == entry["changes"], (argv, env)


@pytest.mark.parametrize("command, flag", [(c, f) for c in ("serve", "route")
                                          for f in BEFORE[c]["flags"]])
def test_the_same_values_are_refused(command, flag):
    before = BEFORE[command]
    parser = PARSER
    refused = set()
    for bad in ("0", "-1", "1", "x", "maybe", "nope", "1.5"):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parser.parse_args([command, *before["base_argv"], flag, bad])
        except SystemExit:
            refused.add(bad)
    expected = set(before["flags"][flag]["rejects"]) - WIDENED.get((command, flag), set())
    assert refused == expected
