"""A setting: one field of a typed config that is also a command-line flag, an environment
variable and a row of docs/settings.md.

The typed configs (``EngineConfig``, ``ServerSettings``, ``ConnectionLimits``,
``RouterSettings``) declare each knob once, as a dataclass field whose metadata carries its
flag, help text, choices and how the command line spells its value
(:func:`setting`). The ``prefixgate`` parser, the defaults an absent flag takes, the
``PREFIXGATE_*`` variables and the docs' table are all read from those fields
(gateway/flags.py, gateway/settings_table.py), so adding a knob is one field.

Standard library only: the engine's config imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

ENV_PREFIX = "PREFIXGATE_"
_SETTING, _NESTED = "prefixgate.setting", "prefixgate.nested"
_UNSET: Any = object()  # "not given" where None is a meaningful value


def env_var(flag: str) -> str:
    """The environment variable that mirrors a CLI flag: ``--kv-memory`` → ``PREFIXGATE_KV_MEMORY``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True, slots=True)
class Setting:
    """How one config field is spelled outside the code.

    The value a flag carries on the command line (its *CLI value*) may differ from the field's:
    a ``switch`` is ``on``/``off`` there and a bool in the field; ``none_word`` is the word that
    means None (``--dtype auto``, ``--kv-tier off``, ``--default-max-tokens 0``); a
    ``repeatable`` flag collects a list that the field keeps as a tuple (or what ``convert``
    makes of it). ``help`` may say ``{default}``: the help and the docs fill in the default.
    """

    flag: str  # the one spelling; the environment variable is derived from it
    help: str
    group: str  # the --help section (and the docs table's)
    type: Callable[[str], Any] | None = None  # text -> CLI value, raising ValueError/ArgumentTypeError
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    switch: bool = False
    none_word: Any = _UNSET
    repeatable: bool = False
    convert: Callable[[Any], Any] | None = None  # CLI value -> field value, instead of the rules
    exclusive: str | None = None  # flags naming the same group exclude each other
    cli_default: Any = _UNSET  # what an absent flag means where it differs from the field's default
    show: Callable[[Any], str] | None = None  # how --help and the docs print the default

    @property
    def env(self) -> str:
        return env_var(self.flag)

    def to_cli(self, value: Any) -> Any:
        """A field value as the command line spells it (how defaults are shown and resolved)."""
        if self.switch:
            return "on" if value else "off"
        if value is None and self.none_word is not _UNSET:
            return self.none_word
        if self.repeatable:
            return list(value or ())
        return value

    def to_field(self, value: Any) -> Any:
        """A resolved CLI value as the field takes it."""
        if self.convert is not None:
            return self.convert(value)
        if self.switch:
            return value == "on"
        if self.none_word is not _UNSET and value == self.none_word:
            return None
        if self.repeatable:
            return tuple(value)
        return value

    def shown(self, cli_value: Any) -> str:
        """The default as --help and the docs print it."""
        if self.show is not None:
            return self.show(cli_value)
        if isinstance(cli_value, float):
            return f"{cli_value:g}"
        if isinstance(cli_value, list):
            return ", ".join(map(str, cli_value)) or "none"
        return str(cli_value)


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, flag: str, help: str,
            group: str, secret: bool = False, **options: Any) -> Any:
    """A dataclass field that is also a flag (see :class:`Setting` for ``options``).

    ``switch=True`` supplies the on/off type and metavar; ``secret=True`` keeps the value out of
    the record's repr (and so out of logs); other options pass through.
    """
    if options.get("switch"):
        options.setdefault("type", on_off)
        options.setdefault("metavar", "on|off")
    spec = Setting(flag=flag, help=help, group=group, **options)
    return dataclasses.field(default=default, default_factory=default_factory, repr=not secret,
                             metadata={_SETTING: spec})


def nested(cls: type) -> Any:
    """A field holding another settings record whose fields are flags of their own
    (``ServerSettings.limits`` is a ``ConnectionLimits``)."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: cls})


@dataclass(frozen=True, slots=True)
class Knob:
    """One setting of a config class: the field's name (the CLI value's key), its spelling and
    its default as the command line spells it."""

    name: str
    spec: Setting
    default: Any  # a CLI value


def knobs(cls: type) -> Iterator[Knob]:
    """The settings of ``cls`` in field order, nested records' flattened in place."""
    for field in dataclasses.fields(cls):
        if _NESTED in field.metadata:
            yield from knobs(field.metadata[_NESTED])
            continue
        spec: Setting | None = field.metadata.get(_SETTING)
        if spec is None:
            continue  # a library-only field: no flag
        if spec.cli_default is not _UNSET:
            default = spec.cli_default
        elif field.default is not MISSING:
            default = spec.to_cli(field.default)
        elif field.default_factory is not MISSING:
            default = spec.to_cli(field.default_factory())
        else:
            default = spec.to_cli(None)
        yield Knob(field.name, spec, default)


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` from resolved CLI values keyed by field name (see :func:`knobs`); a field without a
    setting, or absent from ``values``, keeps its default.

    Raises:
        ValueError: from the record's own validation.
    """
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if _NESTED in field.metadata:
            kwargs[field.name] = build(field.metadata[_NESTED], values)
        elif _SETTING in field.metadata and field.name in values:
            kwargs[field.name] = field.metadata[_SETTING].to_field(values[field.name])
    return cls(**kwargs)


# ----------------------------------------------------------------------------- value types
# Each takes the text of a flag or variable and returns its CLI value, or raises ValueError
# (malformed: argparse says "invalid <type> value") or ArgumentTypeError (out of range: argparse
# prints the reason).


def _bounded(convert: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _bounded(int, lambda v: v >= 1, ">= 1")
positive_int.__name__ = "positive_int"
non_negative_int = _bounded(int, lambda v: v >= 0, ">= 0")
non_negative_int.__name__ = "non_negative_int"
positive_float = _bounded(float, lambda v: v > 0, "> 0")
positive_float.__name__ = "positive_float"
fraction = _bounded(float, lambda v: 0 <= v < 1, "in [0, 1)")
fraction.__name__ = "fraction"

_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def on_off(text: str) -> str:
    """A switch: on/off, also true/false, yes/no, 1/0 (any case); normalised to on/off."""
    value = text.strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    raise argparse.ArgumentTypeError(f"must be on or off, got {text!r}")
