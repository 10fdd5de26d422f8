"""Server settings in one typed place (HTTP, auth, metrics); engine settings live in EngineConfig.

Every field that is a knob of ``prefixgate serve`` carries its flag and help
(:func:`engine.setting.setting`): the CLI flag ``--api-keys-file`` is the environment variable
``PREFIXGATE_API_KEYS_FILE``, and docs/settings.md lists them all. API keys map to tenants
(gateway/http/api_keys.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prefixgate.cache.ttl_policy import TTLPolicy
from prefixgate.engine.setting import (
    nested,
    non_negative_int,
    positive_float,
    positive_int,
    setting,
)
from prefixgate.gateway.http.api_keys import check_token, merge_api_keys, with_keys_file
from prefixgate.gateway.http.limits import ConnectionLimits
from prefixgate.gateway.scaleout.kv_events.config import KVEventsConfig, parse_kv_events_config
from prefixgate.gateway.server.fields import MAX_ALIAS_CHARS, MAX_MODEL_ALIASES

# --tool-call-format: "auto" (the one the chat template teaches) or a registered format
# (gateway/server/tools/formats; a test keeps this list equal to the registry, which the CLI
# does not import: it pulls the grammar compiler)
TOOL_CALL_FORMATS = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "mistral_nemo",
                     "deepseek_r1", "granite", "harmony")
LOG_LEVELS = ("debug", "info", "warning", "error")
# pauses an agent must show before its own learned TTL replaces --retention
_MIN_PAUSES = next(f.default for f in dataclasses.fields(TTLPolicy) if f.name == "min_observations")
_HTTP, _FLEET = "HTTP and auth", "scale-out (behind `prefixgate route`)"


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _key_specs(specs: Iterable[str]) -> dict[str, str]:
    return merge_api_keys(specs, None)


def check_model_aliases(aliases: Iterable[str], source: str = "--model-alias") -> tuple[str, ...]:
    """Bound the alias globs: at most MAX_MODEL_ALIASES, each 1-MAX_ALIAS_CHARS printable."""
    aliases = tuple(aliases)
    if len(aliases) > MAX_MODEL_ALIASES:
        raise ValueError(f"{source}: at most {MAX_MODEL_ALIASES} aliases, got {len(aliases)}")
    for alias in aliases:
        if not 1 <= len(alias) <= MAX_ALIAS_CHARS or not alias.isprintable() or alias != alias.strip():
            raise ValueError(f"{source}: an alias is 1-{MAX_ALIAS_CHARS} printable characters "
                             f"without surrounding spaces, got {alias[:80]!r}")
    return aliases


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """HTTP-side settings (the engine's live in :class:`engine.config.EngineConfig`).

    Auth is on when any API key or an admin key is configured: every endpoint except
    ``/health`` then needs ``Authorization: Bearer <key>``; the cache admin endpoints (pin,
    unpin, reset) and ``/metrics`` (unless ``metrics_public``) need the admin key, and a tenant
    key's ``/v1/cache/stats`` shows only its own tenant.
    """

    host: str = setting("127.0.0.1", flag="--host", group=_HTTP, help="bind address (default {default})")
    port: int = setting(8000, flag="--port", type=int, group=_HTTP,
                        help="port (default {default}; 0 = any free port)")
    # key -> tenant; with api_keys_file, its keys too (read when the settings are made)
    api_keys: Mapping[str, str] = setting(
        default_factory=dict, flag="--api-key", repeatable=True, convert=_key_specs,
        metavar="KEY[:TENANT]", group=_HTTP,
        help="repeatable; a bare KEY is tenant 'default'; any key turns auth on")
    api_keys_file: str | None = setting(
        None, flag="--api-keys-file", metavar="PATH", group=_HTTP,
        help="JSON {key: tenant} / [{key, tenant}], or lines 'KEY [TENANT]'")
    admin_key: str | None = setting(
        None, flag="--admin-key", group=_HTTP,
        help="key for /v1/cache/pin, /unpin, /reset (turns auth on)")
    served_model_name: str | None = setting(  # None = the engine's model name
        None, flag="--served-model-name", group="model and cache",
        help="the name clients put in 'model' (default: the model's own)")
    # more names a request's ``model`` may carry (fnmatch globs: ``claude-*``, ``gpt-5*``), all
    # served by the one model, like vLLM's list of --served-model-name (docs/clients.md)
    model_aliases: tuple[str, ...] = setting(
        (), flag="--model-alias", repeatable=True, metavar="GLOB", group="model and cache",
        help="repeatable; more names a request's 'model' may carry, as fnmatch globs "
        "('claude-*', 'gpt-5*'), all answered by the served model (docs/clients.md)")
    # max_tokens of a request that sends none, cut to what fits the context (None = the rest
    # of the context, as OpenAI's API and vLLM do). On by default: Codex and aider send none,
    # and a small model that never says EOS then streams until the context is full (aider once
    # streamed 1.59 MB for 200 s). 4096 is above any real answer of one turn and the output cap
    # hosted models once had (GPT-4 Turbo, Claude 3); docs/clients.md
    default_max_tokens: int | None = setting(
        4096, flag="--default-max-tokens", type=non_negative_int, none_word=0, metavar="N",
        group=_HTTP,
        help="max_tokens of a request that sends none (Codex, aider), cut to the context left; "
        "0 = the rest of the context, as OpenAI's API (default {default})")
    # a ceiling on any request's output tokens: a larger max_tokens is cut to it (counted in
    # max_tokens_clamped), as a hosted model caps its output. None = no ceiling. Claude Code
    # asks 32,000-64,000 on every turn: a small model that rambles would fill the context
    max_output_tokens: int | None = setting(
        None, flag="--max-output-tokens", type=non_negative_int, none_word=0, metavar="N",
        group=_HTTP,
        help="a ceiling on every request's output tokens: a larger max_tokens is cut to it, as "
        "a hosted model caps its output (Claude Code asks 32,000+); 0 = none (default)")
    # temperature of a request that sends none (1.0, as OpenAI's and Anthropic's APIs);
    # Claude Code and Codex send none: a small local model may want it lower
    default_temperature: float | None = setting(
        1.0, flag="--default-temperature", type=float, group=_HTTP,
        help="temperature of a request that sends none (Claude Code, Codex) (default {default})")
    allowed_origins: tuple[str, ...] = setting(  # CORS stays off unless origins are given
        (), flag="--allowed-origin", repeatable=True, metavar="ORIGIN", group=_HTTP,
        help="repeatable; enables CORS for these origins (off by default)")
    # distinct agent label values in /metrics; the rest are "__other__"
    max_agent_labels: int = setting(
        32, flag="--max-agent-labels", type=int, group=_HTTP,
        help="distinct agent labels in /metrics before '__other__' (default {default})")
    max_stats_agents: int = 200  # agents listed in /v1/cache/stats; the rest are folded together
    # Prompt-text previews of the top shared prefixes in /v1/cache/stats (admin only, with auth
    # on); off = never decoded nor shown to anyone.
    stats_previews: bool = setting(
        True, flag="--stats-previews", switch=True, group=_HTTP,
        help="prompt-text previews of the top shared prefixes in /v1/cache/stats and the "
        "dashboard, shown to the admin key only (default {default}; off = shown to no one)")
    # /metrics carries every tenant and agent label: with auth on it needs the admin key unless
    # this opens it (a Prometheus scraper on a private network).
    metrics_public: bool = setting(
        False, flag="--metrics-public", switch=True, group=_HTTP,
        help="serve /metrics without the admin key even with auth on, e.g. to a Prometheus "
        "scraper on a private network (default {default}: it lists every tenant and agent label)")
    log_level: str = setting("info", flag="--log-level", choices=LOG_LEVELS, group=_HTTP,
                             help="default {default}")
    # Scale-out (gateway/scaleout): publish the cache index, load and stats to Redis when set.
    redis_url: str | None = setting(
        None, flag="--redis-url", group=_FLEET,
        help="publish the cache index, load and stats here (redis://host:6379)")
    # authenticates the fleet's Redis KV tier entries (gateway/scaleout/kv_tier_redis.py)
    kv_tier_secret: str | None = setting(
        None, flag="--kv-tier-secret", metavar="SECRET", secret=True, group="model and cache",
        help="the fleet secret Redis tier entries are authenticated with (a keyed MAC), so "
        "nobody who can write to Redis can plant K/V; required with --kv-tier redis, the same "
        "on every replica, at least 16 characters (prefer the environment variable)")
    replica_id: str | None = setting(  # None = <hostname>-<port>
        None, flag="--replica-id", group=_FLEET,
        help="this replica's id in Redis (default <hostname>-<port>)")
    advertise_url: str | None = setting(  # None = http://<host>:<port>
        None, flag="--advertise-url", group=_FLEET,
        help="the URL routers reach this replica at (default http://host:port)")
    # a router drops this replica when no beat came for this long
    heartbeat_ttl_s: float = setting(
        3.0, flag="--heartbeat-ttl", type=positive_float, metavar="S", group=_FLEET,
        help="routers drop this replica when no heartbeat came for S seconds (default {default})")
    # vLLM-format KV events over ZMQ for external routers (llm-d, Dynamo); None = off
    # (gateway/scaleout/kv_events, docs/fleet.md)
    kv_events: KVEventsConfig | None = setting(
        None, flag="--kv-events-config", type=_kv_events_config, metavar="JSON", group=_FLEET,
        help="publish KV-cache events in vLLM's ZMQ format for llm-d / Dynamo routers; vLLM's "
        "JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}' (default off; docs/fleet.md)")
    # Responses API: stored responses (previous_response_id) expire after this long; at most
    # this many are kept in memory (in Redis, the TTL alone bounds them)
    response_ttl_s: float = setting(
        3600.0, flag="--response-ttl", type=positive_float, metavar="S", group=_FLEET,
        help="Responses API: stored responses (previous_response_id) expire after S seconds "
        "(default {default}; in Redis with --redis-url, else in memory)")
    max_stored_responses: int = setting(
        10_000, flag="--max-stored-responses", type=positive_int, metavar="N", group=_FLEET,
        help="Responses API: at most N stored responses in memory (default {default})")
    # a response ending in tool calls keeps its pages ahead of LRU eviction this long (0 = off)
    retention_s: float = setting(
        30.0, flag="--retention", type=float, metavar="S", group=_FLEET,
        help="a response that ends in tool calls keeps its pages ahead of LRU eviction for S "
        "seconds, until the agent returns with the result (default {default}; 0 = off; requests "
        "may hint it: retention_seconds, X-Retention-Seconds, Anthropic cache_control.ttl)")
    # learn each agent's tool pauses for the default TTL (cache/ttl_policy.py); off = retention_s
    retention_learn: bool = setting(
        True, flag="--retention-learn", switch=True, group=_FLEET,
        help="learn each agent's tool pauses and derive the default TTL from them: margin x "
        "their p90, capped by the prefix's recompute cost; --retention until "
        f"{_MIN_PAUSES} pauses are seen (default {{default}}; off = always --retention)")
    # slow and greedy clients: header/body deadlines, connection and body-size caps
    limits: ConnectionLimits = nested(ConnectionLimits)
    # how the model writes tool calls (gateway/server/tools/dialect.py); "auto": from its
    # chat template, the gateway's Hermes format when the template teaches none
    tool_call_format: str = setting(
        "auto", flag="--tool-call-format", choices=TOOL_CALL_FORMATS, group=_HTTP,
        help="how the model writes tool calls: auto = the format its chat template teaches "
        "(Hermes <tool_call>, Qwen3-Coder XML, Llama 3.x JSON, Mistral [TOOL_CALLS], DeepSeek "
        "R1, Granite <|tool_call|>), the gateway's Hermes prompt when it teaches none "
        "(default {default})")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for key, tenant in self.api_keys.items():
            check_token(key, "API key", "api_keys")
            check_token(tenant, "tenant", "api_keys")
        if self.admin_key is not None:
            check_token(self.admin_key, "admin key", "admin_key")
            if self.admin_key in self.api_keys:
                raise ValueError("the admin key must differ from every tenant API key")
        if not 0 <= self.retention_s <= 3600:
            raise ValueError(f"retention_s must be in [0, 3600], got {self.retention_s}")
        if self.response_ttl_s <= 0 or self.max_stored_responses < 1:
            raise ValueError("response_ttl_s must be > 0 and max_stored_responses >= 1")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        check_model_aliases(self.model_aliases)
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format must be one of {', '.join(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_format!r}")
        if self.default_temperature is not None and not 0 <= self.default_temperature <= 2:
            raise ValueError(f"default_temperature must be in [0, 2], got {self.default_temperature}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        if self.max_agent_labels < 0 or self.max_stats_agents < 0:
            raise ValueError("max_agent_labels and max_stats_agents must be >= 0")
        # Frozen means frozen: nobody adds a key to a running server by mutating the dict.
        keys = with_keys_file(self.api_keys, self.api_keys_file)
        object.__setattr__(self, "api_keys", MappingProxyType(keys))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None
