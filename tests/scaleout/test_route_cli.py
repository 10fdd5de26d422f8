"""``prefixgate route`` flags and their PREFIXGATE_* twins; the serve-side scale-out flags."""

from __future__ import annotations

import pytest

from prefixgate.gateway import cli
from prefixgate.gateway.router.settings import RouterSettings, normalize_url
from prefixgate.gateway.scaleout.publisher import default_advertise_url


def route(argv: list[str], env: dict[str, str]) -> RouterSettings:
    parser = cli.build_parser()
    args = parser.parse_args(["route", *argv])
    return cli.route_settings(cli.resolve(args, parser, env, "route"))


def test_flags_and_environment():
    settings = route(["--replica", "http://A:8000/", "--replica", "http://b:8000",
                      "--redis-url", "redis://redis:6379/0", "--policy", "round_robin"],
                     {"PREFIXGATE_PORT": "9000", "PREFIXGATE_BALANCE_ABS_THRESHOLD": "6"})
    assert settings.replicas == ("http://a:8000", "http://b:8000")
    assert settings.redis_url == "redis://redis:6379/0"
    assert (settings.policy, settings.port, settings.balance_abs_threshold) == (
        "round_robin", 9000, 6)
    env = {"PREFIXGATE_REPLICA": "http://r1:8000, http://r2:8000",
           "PREFIXGATE_API_KEY": "k1:alpha,k2", "PREFIXGATE_HEARTBEAT_TTL": "5"}
    settings = route([], env)
    assert settings.replicas == ("http://r1:8000", "http://r2:8000")
    assert dict(settings.api_keys) == {"k1": "alpha", "k2": "default"}
    assert settings.heartbeat_ttl_s == 5.0 and settings.auth_enabled
    # The command line wins over the environment.
    assert route(["--replica", "http://x:1"], env).replicas == ("http://x:1",)


def test_every_route_flag_has_a_default():
    assert {k.name for k in cli.command_knobs("route")} == set(cli.ROUTE_DEFAULTS)
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    dests = {a.dest for a in sub.choices["route"]._actions if a.option_strings and a.dest != "help"}
    assert dests == set(cli.ROUTE_DEFAULTS)


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "--replica"),
    (["--replica", "a:8000"], {}, "http://host:port"),
    (["--replica", "http://a:1", "--replica", "http://A:1/"], {}, "given twice"),
    (["--replica", "http://a:1", "--redis-url", "localhost:6379"], {}, "redis://"),
    (["--replica", "http://a:1"], {"PREFIXGATE_POLICY": "sticky"}, "PREFIXGATE_POLICY"),
    (["--replica", "http://a:1", "--balance-rel-threshold", "0.5"], {}, "rel_threshold"),
])
def test_bad_route_settings_exit_with_the_reason(capsys, argv, env, message):
    with pytest.raises(SystemExit) as raised:
        cli.main(["route", *argv], environ=env)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_scaleout_flags_reach_the_server_settings():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--redis-url", "redis://r:6379", "--replica-id", "r1"])
    env = {"PREFIXGATE_ADVERTISE_URL": "http://replica-a:8000", "PREFIXGATE_HEARTBEAT_TTL": "2"}
    _, settings = cli.configs(cli.resolve(args, parser, env))
    assert (settings.redis_url, settings.replica_id, settings.advertise_url,
            settings.heartbeat_ttl_s) == ("redis://r:6379", "r1", "http://replica-a:8000", 2.0)


def test_urls():
    assert normalize_url(" HTTP://Replica-A:8000/ ") == "http://replica-a:8000"
    assert default_advertise_url("10.0.0.5", 8001) == "http://10.0.0.5:8001"
    assert default_advertise_url("0.0.0.0", 8001).endswith(":8001")
    with pytest.raises(ValueError, match="advertise-url"):
        default_advertise_url("127.0.0.1", 0)


def test_the_tool_call_format_is_the_replicas_on_both_sides():
    env = {"PREFIXGATE_TOOL_CALL_FORMAT": "hermes"}
    assert route(["--replica", "http://a:1"], env).tool_call_format == "hermes"
    assert route(["--replica", "http://a:1"], {}).tool_call_format == "auto"
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--tool-call-format", "llama3_json"])
    _, settings = cli.configs(cli.resolve(args, parser, env))
    assert settings.tool_call_format == "llama3_json"  # the flag wins over the environment
