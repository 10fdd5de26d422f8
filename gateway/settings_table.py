"""docs/settings.md: every flag of ``prefixgate serve`` and ``prefixgate route`` as a table,
generated from the typed configs (engine/setting.py). A test keeps the file equal to it.

Regenerate: ``python -m prefixgate.gateway.settings_table`` (``--check`` only compares).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefixgate.engine.setting import Knob
from prefixgate.gateway.cli import COMMANDS, command_knobs
from prefixgate.gateway.http.limits import ConnectionLimits

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
_HEAD = """# Settings

Every knob of `prefixgate serve` and `prefixgate route`: its flag, the environment variable that
mirrors it, its default and the config field it fills. The flag wins over the variable, which
wins over the default; a repeatable flag's variable takes a comma-separated list. Generated from
the typed configs (`EngineConfig`, `ServerSettings`, `ConnectionLimits`, `RouterSettings`: each
field carries its flag and help, engine/setting.py) by `python -m prefixgate.gateway.settings_table`;
do not edit by hand (tests/gateway/test_settings_table.py compares).
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(knob: Knob, owner: str) -> str:
    spec = knob.spec
    flag = f"`{spec.flag}`" + (" (repeatable)" if spec.repeatable else "")
    if spec.choices is not None and not isinstance(spec.choices, range):
        flag += " " + "\\|".join(map(str, spec.choices))
    elif spec.switch:
        flag += " on\\|off"
    default = spec.shown(knob.default) if knob.default not in (None, []) else "—"
    meaning = spec.help.replace("{default}", spec.shown(knob.default))
    return (f"| {flag} | `{spec.env}` | {_cell(default)} | `{owner}.{knob.name}` "
            f"| {_cell(meaning)} |")


def _owner(classes: tuple[type, ...], name: str) -> str:
    """The config whose field ``name`` is (a nested record's fields are its own)."""
    for cls in (*classes, ConnectionLimits):
        if name in cls.__dataclass_fields__:  # type: ignore[attr-defined]
            return cls.__name__
    raise KeyError(name)


def render() -> str:
    """The whole of docs/settings.md."""
    parts = [_HEAD]
    for command, classes in COMMANDS.items():
        parts.append(f"\n## `prefixgate {command}`\n")
        group = None
        for knob in command_knobs(command):
            if knob.spec.group != group:
                group = knob.spec.group
                parts.append(f"\n### {group}\n\n| flag | variable | default | field | meaning |\n"
                             "|---|---|---|---|---|")
            parts.append(_row(knob, _owner(classes, knob.name)))
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is stale: run python -m prefixgate.gateway.settings_table", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
