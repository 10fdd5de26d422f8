"""A command's flags generated from its typed configs, and how a value is resolved: the
command line, else the ``PREFIXGATE_*`` variable, else the default (engine/setting.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from prefixgate.engine.setting import Knob, knobs

# --help sections with a line of their own under the title
GROUP_HELP = {
    "slow and greedy clients":
        "limits per connection and request; none applies to a response, so streams are never cut",
}


def command_knobs(classes: Sequence[type]) -> list[Knob]:
    """The settings of a command whose values fill ``classes``; a field two configs share (the
    served model name) is one flag.

    Raises:
        ValueError: two fields of one name spelled differently.
    """
    found: dict[str, Knob] = {}
    for cls in classes:
        for knob in knobs(cls):
            seen = found.setdefault(knob.name, knob)
            if seen.spec.flag != knob.spec.flag or seen.default != knob.default:
                raise ValueError(f"{cls.__name__}.{knob.name} disagrees with {seen.spec.flag}")
    return list(found.values())


def defaults(classes: Sequence[type]) -> dict[str, Any]:
    """What an absent flag (and its absent variable) takes, keyed by field name."""
    return {knob.name: knob.default for knob in command_knobs(classes)}


def add_flags(parser: argparse.ArgumentParser, classes: Sequence[type]) -> None:
    """One ``--flag`` per setting of ``classes``, in sections by group, help defaults filled in.

    Every flag leaves its attribute unset when absent (``argparse.SUPPRESS``), so that
    :func:`resolve` can tell "not given" from "given the default".
    """
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for knob in command_knobs(classes):
        spec = knob.spec
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group, GROUP_HELP.get(spec.group))
        target = groups[spec.group]
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = target.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        options: dict[str, Any] = {"dest": knob.name, "default": argparse.SUPPRESS,
                                   "help": spec.help.replace("{default}", spec.shown(knob.default))}
        if spec.repeatable:
            options["action"] = "append"
        for key in ("type", "choices", "metavar"):
            if getattr(spec, key) is not None:
                options[key] = getattr(spec, key)
        target.add_argument(spec.flag, **options)


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser, classes: Sequence[type],
            environ: Mapping[str, str]) -> dict[str, Any]:
    """CLI values keyed by field name: flags given on the command line, else ``PREFIXGATE_*``
    variables (a repeatable flag's variable is comma-separated), else defaults.

    Raises:
        SystemExit: via ``parser.error`` on a malformed variable (naming it), or two exclusive
            settings both given.
    """
    values: dict[str, Any] = {}
    given: dict[str, list[Knob]] = {}
    for knob in command_knobs(classes):
        if hasattr(args, knob.name):
            values[knob.name] = getattr(args, knob.name)
        else:
            raw = environ.get(knob.spec.env)
            values[knob.name] = knob.default if raw in (None, "") else _from_env(knob, raw, parser)
        if knob.spec.exclusive is not None and values[knob.name] is not None:
            given.setdefault(knob.spec.exclusive, []).append(knob)
    for both in given.values():
        if len(both) > 1:
            parser.error("give one of " + " and ".join(
                f"{knob.spec.flag} / {knob.spec.env}" for knob in both))
    return values


def _from_env(knob: Knob, raw: str, parser: argparse.ArgumentParser) -> Any:
    spec = knob.spec
    convert = spec.type or str
    try:
        if spec.repeatable:
            value: Any = [convert(item.strip()) for item in raw.split(",") if item.strip()]
        else:
            value = convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{spec.env}={raw!r}: {exc}")
    if spec.choices is not None and value not in spec.choices:
        parser.error(f"{spec.env}={raw!r}: choose from {', '.join(map(str, spec.choices))}")
    return value
