"""The cache-stats JSON pieces both the server's ``/v1/cache/stats`` and the router's fleet-wide
one write: hit counters, the busiest agents or tenants with the rest folded, and whose view an
answer is. One module, so a replica's answer and the fleet's sum read the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixgate.cache.stats import HitStats
from prefixgate.gateway.http.auth import Principal
from prefixgate.gateway.http.metric_labels import OTHER_LABEL


def hit_json(stats: HitStats) -> dict[str, Any]:
    return {
        "requests": stats.requests,
        "query_tokens": stats.query_tokens,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": round(stats.hit_rate, 6),
        "tokens_saved": stats.hit_tokens,  # a hit token is a prompt token not recomputed
        # hits on pages retention kept for a returning turn (cache/stats.py)
        "retention_hits": stats.retention_hits,
        "retention_hit_tokens": stats.retention_hit_tokens,
    }


def busiest(per_key: Mapping[str, HitStats], limit: int) -> dict[str, dict[str, Any]]:
    """The ``limit`` keys with most query tokens; the rest summed under ``__other__``."""
    ranked = sorted(per_key.items(), key=lambda kv: (-kv[1].query_tokens, kv[0]))
    out = {key: hit_json(stats) for key, stats in ranked[:limit]}
    rest = [stats for _, stats in ranked[limit:]]
    if rest:
        folded = HitStats(
            requests=sum(s.requests for s in rest),
            query_tokens=sum(s.query_tokens for s in rest),
            hit_tokens=sum(s.hit_tokens for s in rest),
            retention_hits=sum(s.retention_hits for s in rest),
            retention_hit_tokens=sum(s.retention_hit_tokens for s in rest),
        )
        out[OTHER_LABEL] = {**hit_json(folded), "num_agents": len(rest)}
    return out


def scope_json(principal: Principal, auth_enabled: bool) -> dict[str, Any]:
    """Whose view a stats answer is: ``open`` (no auth), ``admin`` (all tenants) or ``tenant``."""
    if not auth_enabled:
        return {"scope": "open"}
    if principal.is_admin:
        return {"scope": "admin"}
    return {"scope": "tenant", "tenant": principal.tenant}
