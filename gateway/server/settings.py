"""Server settings in one typed place (HTTP, auth, metrics); engine settings live in EngineConfig.

Every knob has one name: the CLI flag ``--api-keys-file`` is the environment variable
``PREFIXGATE_API_KEYS_FILE`` (see :func:`env_var`). API keys map to tenants: pages are shared
only within a tenant, because the engine salts every block hash with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from prefixgate.gateway.scaleout.kv_events.config import KVEventsConfig
from prefixgate.gateway.server.fields import MAX_ALIAS_CHARS, MAX_MODEL_ALIASES
from prefixgate.gateway.server.limits import ConnectionLimits

DEFAULT_TENANT = "default"
ENV_PREFIX = "PREFIXGATE_"

# --tool-call-format: "auto" (the one the chat template teaches) or a registered format
# (gateway/server/tools/formats; a test keeps this list equal to the registry, which the CLI
# does not import: it pulls the grammar compiler)
TOOL_CALL_FORMATS = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "mistral_nemo",
                     "deepseek_r1", "granite", "harmony")

# Tenants and keys travel in headers, logs and metric labels: keep them printable and short.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=@-]{1,256}$")


def env_var(flag: str) -> str:
    """The environment variable that mirrors a CLI flag: ``--kv-memory`` → ``PREFIXGATE_KV_MEMORY``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _check_token(value: str, what: str, source: str) -> str:
    if not _TOKEN_RE.match(value):
        raise ValueError(
            f"{source}: invalid {what} {value!r} (1-256 characters from A-Z a-z 0-9 . _ ~ + / = @ -)"
        )
    return value


def parse_api_key(spec: str, source: str = "--api-key") -> tuple[str, str]:
    """Parse ``KEY`` or ``KEY:TENANT``; a bare key belongs to the ``default`` tenant.

    The key ends at the first ``:`` (a key containing ``:`` must come from a keys file).
    """
    key, sep, tenant = spec.strip().partition(":")
    if sep and not tenant:
        raise ValueError(f"{source}: empty tenant in {spec!r} (use KEY or KEY:TENANT)")
    return _check_token(key, "API key", source), _check_token(
        tenant or DEFAULT_TENANT, "tenant", source
    )


def load_api_keys_file(path: str | Path) -> dict[str, str]:
    """Read an API-keys file into ``{key: tenant}``.

    Accepted formats (chosen by the first non-blank character):

    * JSON object ``{"KEY": "TENANT", ...}``;
    * JSON list of ``{"key": "KEY", "tenant": "TENANT"}`` objects or ``"KEY[:TENANT]"`` strings;
    * text, one ``KEY [TENANT]`` per line (whitespace-separated; ``#`` starts a comment).

    Raises:
        ValueError: naming the file (and line) on any malformed entry or duplicate key.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-keys-file: cannot read {path}: {exc.strerror or exc}") from exc
    keys = _KeysFile(path)
    if text.lstrip().startswith(("{", "[")):
        keys.read_json(text)
    else:
        keys.read_lines(text)
    return keys.keys


class _KeysFile:
    """The ``{key: tenant}`` map of one API-keys file as it is read; errors name the file."""

    def __init__(self, path: Path):
        self.path = path
        self.keys: dict[str, str] = {}

    def add(self, key: str, tenant: str, where: str) -> None:
        source = f"{self.path}{where}"
        key = _check_token(key, "API key", source)
        tenant = _check_token(tenant, "tenant", source)
        if key in self.keys:
            raise ValueError(f"{source}: duplicate API key")
        self.keys[key] = tenant

    def read_json(self, text: str) -> None:
        path = self.path
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        if isinstance(data, dict):
            for key, tenant in data.items():
                if not isinstance(tenant, str):
                    raise ValueError(f"{path}: tenant of key {key!r} must be a string")
                self.add(key, tenant, "")
            return
        for i, item in enumerate(data):
            self.read_entry(item, f" [entry {i}]")

    def read_entry(self, item: object, where: str) -> None:
        """One entry of a JSON list: ``"KEY[:TENANT]"`` or ``{"key": ..., "tenant": ...}``."""
        if isinstance(item, str):
            self.add(*parse_api_key(item, f"{self.path}{where}"), where)
        elif isinstance(item, dict) and isinstance(item.get("key"), str):
            tenant = item.get("tenant", DEFAULT_TENANT)
            if not isinstance(tenant, str):
                raise ValueError(f"{self.path}{where}: 'tenant' must be a string")
            self.add(item["key"], tenant, where)
        else:
            raise ValueError(
                f'{self.path}{where}: expected "KEY[:TENANT]" or {{"key": ..., "tenant": ...}}'
            )

    def read_lines(self, text: str) -> None:
        """One ``KEY [TENANT]`` per line; ``#`` starts a comment."""
        for lineno, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(
                    f"{self.path}:{lineno}: expected 'KEY [TENANT]', got {len(fields)} fields"
                )
            self.add(fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT, f":{lineno}")


def merge_api_keys(specs: Iterable[str], keys_file: str | Path | None) -> dict[str, str]:
    """Combine ``--api-key`` specs and an ``--api-keys-file`` into one ``{key: tenant}`` map."""
    keys = load_api_keys_file(keys_file) if keys_file else {}
    for spec in specs:
        key, tenant = parse_api_key(spec)
        if keys.get(key, tenant) != tenant:
            raise ValueError(
                f"--api-key: key given twice with different tenants ({keys[key]!r}, {tenant!r})"
            )
        keys[key] = tenant
    return keys


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
    """HTTP-side settings (the engine's live in :class:`gateway.engine.config.EngineConfig`).

    Auth is on when any API key or an admin key is configured: every endpoint except
    ``/health`` then needs ``Authorization: Bearer <key>``; the cache admin endpoints (pin,
    unpin, reset) and ``/metrics`` (unless ``metrics_public``) need the admin key, and a tenant
    key's ``/v1/cache/stats`` shows only its own tenant.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant
    admin_key: str | None = None
    served_model_name: str | None = None  # None = the engine's model name
    # more names a request's ``model`` may carry (fnmatch globs: ``claude-*``, ``gpt-5*``), all
    # served by the one model, like vLLM's list of --served-model-name (docs/clients.md)
    model_aliases: tuple[str, ...] = ()
    # max_tokens of a request that sends none, cut to what fits the context (None = the rest
    # of the context, as OpenAI's API and vLLM do). On by default: Codex and aider send none,
    # and a small model that never says EOS then streams until the context is full (aider once
    # streamed 1.59 MB for 200 s). 4096 is above any real answer of one turn and the output cap
    # hosted models once had (GPT-4 Turbo, Claude 3); docs/clients.md
    default_max_tokens: int | None = 4096
    # a ceiling on any request's output tokens: a larger max_tokens is cut to it (counted in
    # max_tokens_clamped), as a hosted model caps its output. None = no ceiling. Claude Code
    # asks 32,000-64,000 on every turn: a small model that rambles would fill the context
    max_output_tokens: int | None = None
    # temperature of a request that sends none (1.0, as OpenAI's and Anthropic's APIs);
    # Claude Code and Codex send none: a small local model may want it lower
    default_temperature: float | None = 1.0
    allowed_origins: tuple[str, ...] = ()  # CORS stays off unless origins are given
    max_agent_labels: int = 32  # distinct agent label values in /metrics; the rest are "__other__"
    max_stats_agents: int = 200  # agents listed in /v1/cache/stats; the rest are folded together
    # Prompt-text previews of the top shared prefixes in /v1/cache/stats (admin only, with auth
    # on); off = never decoded nor shown to anyone.
    stats_previews: bool = True
    # /metrics carries every tenant and agent label: with auth on it needs the admin key unless
    # this opens it (a Prometheus scraper on a private network).
    metrics_public: bool = False
    log_level: str = "info"
    # Scale-out (gateway/scaleout): publish the cache index, load and stats to Redis when set.
    redis_url: str | None = None
    # authenticates the fleet's Redis KV tier entries (gateway/scaleout/kv_tier_redis.py)
    kv_tier_secret: str | None = field(default=None, repr=False)
    replica_id: str | None = None  # None = <hostname>-<port>
    advertise_url: str | None = None  # None = http://<host>:<port>
    heartbeat_ttl_s: float = 3.0  # a router drops this replica when no beat came for this long
    # vLLM-format KV events over ZMQ for external routers (llm-d, Dynamo); None = off
    # (gateway/scaleout/kv_events, docs/fleet.md)
    kv_events: KVEventsConfig | None = None
    # Responses API: stored responses (previous_response_id) expire after this long; at most
    # this many are kept in memory (in Redis, the TTL alone bounds them)
    response_ttl_s: float = 3600.0
    max_stored_responses: int = 10_000
    # a response ending in tool calls keeps its pages ahead of LRU eviction this long (0 = off)
    retention_s: float = 30.0
    # learn each agent's tool pauses for the default TTL (cache/ttl_policy.py); off = retention_s
    retention_learn: bool = True
    # slow and greedy clients: header/body deadlines, connection and body-size caps
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # how the model writes tool calls (gateway/server/tools/dialect.py); "auto": from its
    # chat template, the gateway's Hermes format when the template teaches none
    tool_call_format: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for key, tenant in self.api_keys.items():
            _check_token(key, "API key", "api_keys")
            _check_token(tenant, "tenant", "api_keys")
        if self.admin_key is not None:
            _check_token(self.admin_key, "admin key", "admin_key")
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
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None
