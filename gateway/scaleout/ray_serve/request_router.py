"""Our prefix-aware Ray Serve ``RequestRouter``: block hashes from the replicas' KV events,
weighed against load by the same policy as ``prefixgate route`` (gateway/router/policy.py).

Ray Serve builds one router per deployment handle, in the process that holds the handle (the
ingress). Each replica reports where its KV events are published through Ray's routing stats
(``PrefixgateReplica.record_routing_stats``); the router follows those streams
(``BlockIndex``) and, per request, scores every candidate by the leading blocks of the prompt
it holds (``ForwardedRequest.block_hashes``) and its load (requests this router has in flight
there, or Ray's queue-length cache if that says more). ``CacheAwarePolicy`` picks one; Ray gets
it as the first rank and the rest, least loaded first, as the fallback (a replica at
``max_ongoing_requests`` is skipped by Ray).

Why not Ray's ``PrefixCacheAffinityRouter``: it matches the characters of prompts it has
routed itself, not the blocks a replica still holds, so it cannot see evictions, other
ingresses, or the chat template (benchmarks/ray_routing.py compares the two).
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixgate.gateway.router.policy import CacheAwarePolicy, Candidate
from prefixgate.gateway.scaleout.ray_serve.block_index import BlockIndex
from prefixgate.gateway.scaleout.ray_serve.forwarded import ForwardedRequest

# routers alive in this process (the ingress reports them at /ray/router)
LIVE_ROUTERS: weakref.WeakSet[PrefixAwareRequestRouter] = weakref.WeakSet()

ROUTING_STATS_EVENTS = "kv_events"  # keys of PrefixgateReplica.record_routing_stats
ROUTING_STATS_REPLAY = "kv_events_replay"
ROUTING_STATS_BLOCK_SIZE = "block_size"


def forwarded_of(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    """The ``ForwardedRequest`` among a pending request's arguments, if any."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ForwardedRequest):
            return arg
    return None


class PrefixAwareRequestRouter(RequestRouter):
    """Ray Serve request router placing a prompt where its leading blocks are cached.

    ``request_router_kwargs`` (``initialize_state``): ``abs_threshold``, ``rel_threshold``,
    ``match_tolerance`` as ``prefixgate route``'s load guard and tie rules.
    """

    def initialize_state(self, abs_threshold: int = 4, rel_threshold: float = 1.5,
                         match_tolerance: float = 0.02, **_: Any) -> None:
        self.policy = CacheAwarePolicy(abs_threshold, rel_threshold, match_tolerance)
        self.index = BlockIndex()
        self.in_flight: Counter[ReplicaID] = Counter()
        self.reasons: Counter[str] = Counter()
        self.decisions: deque[tuple[str, str]] = deque(maxlen=4096)  # (replica, reason)
        # NOTE: through the module, not this module's global: Ray cloudpickles the router
        # class by value, and the copy's globals are copies too
        from prefixgate.gateway.scaleout.ray_serve import request_router

        request_router.LIVE_ROUTERS.add(self)

    # ------------------------------------------------------------------ Ray's hooks

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        request = forwarded_of(pending_request)
        self._follow_all()
        candidates = []
        for replica in candidate_replicas:
            key = replica.replica_id.to_full_id_str()
            matched = 0
            if request is not None and request.block_hashes:
                block_size = int(replica.routing_stats.get(ROUTING_STATS_BLOCK_SIZE, 0))
                matched = self.index.matched_blocks(key, request.block_hashes) * block_size
            candidates.append(Candidate(key, matched, self._load(replica)))
        if not candidates:
            return []
        num_tokens = request.num_tokens if request is not None else 0
        salt = self._salt(request)
        decision = self.policy.choose(candidates, num_tokens, salt)
        self.reasons[decision.reason] += 1
        self.decisions.append((decision.key, decision.reason))
        chosen = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == decision.key]
        rest = sorted((r for r in candidate_replicas if r not in chosen), key=self._load)
        return [chosen, rest] if rest else [chosen]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.to_full_id_str())
        self.in_flight.pop(replica_id, None)

    # ------------------------------------------------------------------ helpers

    def _follow_all(self) -> None:
        """Follow every known replica whose routing stats name its KV events (they arrive with
        Ray's first stats poll, after the replica joined: checked on every request and every
        /ray/router look)."""
        for replica in list(self._replicas.values()):
            stats = replica.routing_stats or {}
            endpoint = stats.get(ROUTING_STATS_EVENTS)
            if endpoint:
                self.index.watch(replica.replica_id.to_full_id_str(), endpoint,
                                 stats.get(ROUTING_STATS_REPLAY))

    def _load(self, replica: RunningReplica) -> int:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return max(self.in_flight[replica.replica_id], cached or 0)

    @staticmethod
    def _salt(request: ForwardedRequest | None) -> str:
        """The session (X-Agent-Id) if the client named one, else the prompt's first block:
        ties between equal replicas then spread by session and stay put per session."""
        if request is None:
            return ""
        for name, value in request.headers:
            if name.lower() == "x-agent-id" and value:
                return value
        return str(request.block_hashes[0]) if request.block_hashes else ""

    def snapshot(self) -> dict[str, Any]:
        """What the ingress shows at /ray/router: blocks held per replica, reasons."""
        self._follow_all()
        return {
            "replicas": {key: {"blocks": len(r.held), "batches": r.batches, "gaps": r.gaps}
                         for key, r in list(self.index.replicas.items())},
            "reasons": dict(self.reasons),
            "decisions": len(self.decisions),
            "errors": self.index.errors,
        }
