"""The ``prefixgate`` command: ``prefixgate serve`` (one replica) and ``prefixgate route``.

Every flag has an environment twin: ``--kv-memory 4`` is ``PREFIXGATE_KV_MEMORY=4``
(repeatable flags take a comma-separated list). The command line wins over the environment,
which wins over the defaults. The flags are generated from the typed configs' fields
(engine/setting.py); docs/settings.md lists them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.setting import Knob, build
from prefixgate.gateway import flags
from prefixgate.gateway.router.settings import RouterSettings
from prefixgate.gateway.server.settings import ServerSettings

# each command and the configs its flags fill
COMMANDS: dict[str, tuple[type, ...]] = {
    "serve": (EngineConfig, ServerSettings),
    "route": (RouterSettings,),
}
_DESCRIPTIONS = {
    "serve": ("serve one model behind the OpenAI-compatible API",
              "Serve one model behind the OpenAI-compatible API. Every --flag can also be set as "
              "PREFIXGATE_FLAG (e.g. --kv-memory → PREFIXGATE_KV_MEMORY)."),
    "route": ("cache-aware router in front of several replicas",
              "Route OpenAI requests over several `prefixgate serve` replicas: each request goes "
              "to the replica holding the longest cached prefix of its prompt unless that replica "
              "is overloaded. Every --flag can also be set as PREFIXGATE_FLAG (--replica takes a "
              "comma-separated PREFIXGATE_REPLICA)."),
}
# the CLI value an absent flag (and its absent PREFIXGATE_* twin) takes, by field name
DEFAULTS: dict[str, Any] = flags.defaults(COMMANDS["serve"])
ROUTE_DEFAULTS: dict[str, Any] = flags.defaults(COMMANDS["route"])


def command_knobs(command: str) -> list[Knob]:
    """The settings ``prefixgate <command>`` takes, in --help order."""
    return flags.command_knobs(COMMANDS[command])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,route}")
    for command, classes in COMMANDS.items():
        short, description = _DESCRIPTIONS[command]
        flags.add_flags(sub.add_parser(command, help=short, description=description), classes)
    return parser


def resolve(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    command: str = "serve",
) -> dict[str, Any]:
    """Flags given on the command line, else ``PREFIXGATE_*`` variables, else defaults, keyed
    by the field each fills.

    Raises:
        SystemExit: via ``parser.error`` on a malformed environment value (naming the variable).
    """
    return flags.resolve(args, parser, COMMANDS[command], environ)


def configs(values: Mapping[str, Any]) -> tuple[EngineConfig, ServerSettings]:
    """Split resolved values into the engine's config and the server's settings."""
    return build(EngineConfig, values), build(ServerSettings, values)


def route_settings(values: Mapping[str, Any]) -> RouterSettings:
    """Resolved ``prefixgate route`` values → RouterSettings (ValueError naming the problem)."""
    return build(RouterSettings, values)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    if args.command == "route":
        return _route(parser, args, environ)
    values = resolve(args, parser, environ)
    try:
        engine_config, settings = configs(values)
        from prefixgate.engine.precision import check_precision  # torch: only to serve

        check_precision(engine_config.device, engine_config.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    _log_to_stderr(settings.log_level)
    from prefixgate.gateway.server.launch import serve  # uvicorn and the app only when serving

    try:
        serve(engine_config, settings)
    except KeyboardInterrupt:
        # uvicorn re-raises the signal after its graceful shutdown: Ctrl-C is a normal stop.
        logging.getLogger("prefixgate.server").info("prefixgate stopped")
    return 0


def _log_to_stderr(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _route(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> int:
    values = resolve(args, parser, environ, "route")
    try:
        settings = route_settings(values)
    except ValueError as exc:
        parser.error(str(exc))
    _log_to_stderr(settings.log_level)
    from prefixgate.gateway.router.launch import (
        serve_router,  # uvicorn, the tokenizer only when routing
    )

    try:
        serve_router(settings)
    except KeyboardInterrupt:
        logging.getLogger("prefixgate.router").info("prefixgate router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
