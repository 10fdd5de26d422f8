"""Router settings in one typed place. CLI flags mirror them (``prefixgate route --help``) and
every flag has its ``PREFIXGATE_*`` environment twin, as for ``prefixgate serve``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE
from prefixgate.gateway.server.limits import ConnectionLimits

POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "random")


def normalize_url(url: str) -> str:
    """``http://Host:8000/`` → ``http://host:8000`` (how replicas are matched to heartbeats).

    Raises:
        ValueError: not an http(s) URL.
    """
    url = url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest:
        raise ValueError(f"replica URL must look like http://host:port, got {url!r}")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """How the router finds replicas, hashes prompts, and weighs cache affinity against load.

    The hashing fields (``model``, ``page_size``, ``hash_seed``, ``api_keys``) must match the
    replicas' or no prefix ever matches; the router checks page size, seed and model id against
    the replicas' heartbeats and logs a mismatch.
    """

    replicas: tuple[str, ...]
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    model: str | None = None  # GGUF / HF dir whose tokenizer the replicas use (None = default)
    page_size: int = 16
    hash_seed: int = 0
    parse_special_tokens: bool = False  # as the replicas' --parse-special-tokens
    tool_call_format: str = "auto"  # as the replicas' --tool-call-format (the prompt with tools)
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant, as the replicas
    admin_key: str | None = None
    # Load guard: a replica is skipped for affinity when its load exceeds the least-loaded
    # replica's by >= balance_abs_threshold requests AND is >= balance_rel_threshold times it.
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    # Prefix matches within this fraction of the prompt count as equal: load decides.
    match_tolerance: float = 0.02
    # A block in the fleet's Redis KV tier counts as this fraction of a cached block on replicas
    # loading from it, until a replica's heartbeat reports its measured discount; 0 = ignore
    tier_discount: float = 0.5
    heartbeat_ttl_s: float = 3.0  # poll pace for heartbeats (TTL / 3) and the janitor's grace
    health_interval_s: float = 1.0  # own /health probes of every replica
    recent_route_ttl_s: float = 10.0  # trust our own routing of a prefix until Redis shows it
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # between bytes of an upstream response
    redis_timeout_s: float = 0.25  # per index lookup; slower = Redis counted as down
    namespace: str = DEFAULT_NAMESPACE
    seed: int = 0  # the random policy's seed (benchmarks)
    log_level: str = "info"
    # /metrics lists every tenant and agent label: with auth on it needs the admin key unless
    # this opens it (a Prometheus scraper on a private network)
    metrics_public: bool = False
    # slow and greedy clients, as on a replica (gateway/server/limits.py)
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica URL")
        urls = tuple(normalize_url(u) for u in self.replicas)
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica URL is given twice: {', '.join(self.replicas)}")
        object.__setattr__(self, "replicas", urls)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0 <= self.tier_discount <= 1:
            raise ValueError(f"tier_discount must be in [0, 1], got {self.tier_discount}")
        if not 0 <= self.match_tolerance < 1:
            raise ValueError(f"match_tolerance must be in [0, 1), got {self.match_tolerance}")
        for name in ("heartbeat_ttl_s", "health_interval_s", "connect_timeout_s",
                     "request_timeout_s", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.recent_route_ttl_s < 0:
            raise ValueError("recent_route_ttl_s must be >= 0")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None
