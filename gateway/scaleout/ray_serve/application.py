"""The Ray Serve application: an ingress deployment in front of N replica deployments, routed
by the request router named in the options (ours by default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixgate.gateway.scaleout.ray_serve.ingress import IngressOptions, PrefixgateIngress
from prefixgate.gateway.scaleout.ray_serve.replica import PrefixgateReplica, ReplicaOptions

# --router: ours, Ray Serve LLM's character-prefix router, Ray's default (power of two choices)
ROUTERS = {
    "prefix": "prefixgate.gateway.scaleout.ray_serve.request_router.PrefixAwareRequestRouter",
    # (its public alias, ray.serve.llm.request_router, imports ray.serve.llm: pyarrow and more)
    "prefix_cache_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware."
    "prefix_aware_router.PrefixCacheAffinityRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
}


@dataclass(frozen=True, slots=True)
class RayServeOptions:
    """One prefixgate application on Ray Serve.

    ``replica_resources`` are Ray custom resources each replica asks for (``{"prefixgate": 1}``
    with one such resource per node puts one replica on each node). ``routing_stats_period_s``
    is how often Ray asks each replica where its KV events are (the router follows a replica's
    blocks from the first answer on; until then it places by load alone).
    """

    num_replicas: int = 2
    router: str = "prefix"
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    replica: ReplicaOptions = field(default_factory=ReplicaOptions)
    replica_num_cpus: float = 1.0
    replica_resources: dict[str, float] = field(default_factory=dict)
    ingress_num_cpus: float = 0.1
    max_ongoing_requests: int = 64
    routing_stats_period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")


def build_application(options: RayServeOptions) -> serve.Application:
    """The bound application, ready for ``serve.run(app, route_prefix="/")``."""
    router = RequestRouterConfig(request_router_class=ROUTERS[options.router],
                                 request_router_kwargs=options.router_kwargs,
                                 request_routing_stats_period_s=options.routing_stats_period_s)
    actor: dict[str, Any] = {"num_cpus": options.replica_num_cpus}
    if options.replica_resources:
        actor["resources"] = dict(options.replica_resources)
    replica = serve.deployment(PrefixgateReplica, name="PrefixgateReplica").options(
        num_replicas=options.num_replicas, ray_actor_options=actor,
        max_ongoing_requests=options.max_ongoing_requests, request_router_config=router,
        health_check_period_s=5, graceful_shutdown_timeout_s=10,
    ).bind(options.replica)
    engine = options.replica.engine
    hashing = IngressOptions(model=engine.get("model"), page_size=engine.get("page_size", 16),
                             hash_seed=engine.get("hash_seed", 0))
    ingress = serve.deployment(PrefixgateIngress, name="PrefixgateIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": options.ingress_num_cpus},
        max_ongoing_requests=options.max_ongoing_requests * options.num_replicas,
    )
    return ingress.bind(replica, hashing)
