"""Cache endpoints: JSON stats (global, per tenant, per agent, pages, top shared prefixes, engine),
and the admin action reset (admin key required when auth is on). Pin / unpin take the same
OpenAI-shaped inputs as /tokenize, so their routes are the OpenAI surface's (openai/routes.py);
what they do with the token ids is :func:`pin_prefix`, here.

With auth on, a tenant key's stats cover its own tenant only; the admin key sees all tenants.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from prefixgate.cache.stats import CacheStats
from prefixgate.cache.ttl_policy import TTLPolicy
from prefixgate.engine.api import EngineStats
from prefixgate.gateway.http.auth import Principal, authenticate, require_admin
from prefixgate.gateway.http.stats_json import busiest, hit_json, scope_json
from prefixgate.gateway.server.retention import retention_policy
from prefixgate.gateway.server.state import ServerState, server_state

router = APIRouter()

PREFIX_PREVIEW_WORDS = 12
TOP_PREFIXES = 5  # shown per answer (the snapshot holds up to this many per tenant)


def preview(text: str) -> str:
    words = text.split()
    head = " ".join(words[:PREFIX_PREVIEW_WORDS])
    return head + (" …" if len(words) > PREFIX_PREVIEW_WORDS else "")


def policy_json(policy: TTLPolicy, tenants: list[str], limit: int) -> dict[str, Any]:
    """The learned retention TTLs (cache/ttl_policy.py) of ``tenants``' agents, at most
    ``limit`` per tenant (most pauses seen first)."""
    agents: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        known = sorted(policy.agents(tenant).items(), key=lambda kv: (-kv[1].num_pauses, kv[0]))
        if known:
            agents[tenant] = {
                agent: {
                    "pauses": a.num_pauses,
                    "pause_quantile_s": None if a.pause_quantile_s is None
                    else round(a.pause_quantile_s, 3),
                    "ttl_s": round(a.ttl_s, 3),  # before each prefix's recompute-cost cap
                    "source": a.source,
                }
                for agent, a in known[:limit]
            }
    return {
        "learn": policy.learn,
        "prior_s": policy.prior_s,
        "quantile": policy.quantile,
        "margin": policy.margin,
        "min_observations": policy.min_observations,
        "recompute_s_per_token": policy.recompute.s_per_token,
        "recompute_samples": policy.recompute.num_samples,
        "agents": agents,
    }


async def stats_json(
    state: ServerState, principal: Principal, policy: TTLPolicy | None = None
) -> dict[str, Any]:
    """The stats ``principal`` may see (with ``policy``: the learned retention TTLs too).

    NOTE: a tenant key sees only its own tenant (:meth:`CacheStats.for_tenant`): another
    tenant's name, agent labels, counters or prompt text would disclose its traffic (the
    observability twin of the cache's tenant salt). Prompt-text previews go to the admin only,
    and to no one with ``--stats-previews off``.
    """
    cache = await state.cache_stats()
    engine = await state.engine_stats()
    if not principal.is_admin:
        cache = cache.for_tenant(principal.tenant)
    with_text = principal.is_admin and state.settings.stats_previews
    return {
        "object": "cache.stats",
        "model": state.model_name,
        **scope_json(principal, state.settings.auth_enabled),
        "global": hit_json(cache.total),
        "per_tenant": busiest(cache.per_tenant, max(len(cache.per_tenant), 1)),
        "per_agent": busiest(cache.per_agent, state.settings.max_stats_agents),
        **pages_json(cache),
        "top_prefixes": await _prefixes_json(state, cache, with_text),
        **({} if policy is None else {"retention_policy": policy_json(
            policy, policy.tenants() if principal.is_admin else [principal.tenant],
            state.settings.max_stats_agents)}),
        "engine": engine_json(engine),
        **_shared_json(state, principal, engine),
    }


def pages_json(cache: CacheStats) -> dict[str, Any]:
    """The pool: pages by state, retention, pressure (a tenant's view counts its own pages
    under retention only)."""
    return {
        "num_pages": cache.num_pages,
        "page_size": cache.page_size,
        "pages_used": cache.pages_used,
        "pages_cached_free": cache.pages_cached_free,
        "pages_free": cache.pages_free,
        "pages_pinned": cache.pages_pinned,
        "pages_retained": cache.pages_retained,
        "retained_evicted": cache.retained_evicted,
        "retention_expiries": cache.retention_expiries,
        "retention_reclaimed": cache.retention_reclaimed,
        # pages each tenant's retention budget pays for (a tenant key sees only its own)
        "retained_per_tenant": dict(sorted(cache.retained_per_tenant.items())),
        "kv_cache_usage": round(cache.usage, 6),
        "fragmentation": round(cache.fragmentation, 6),
        "evictions": cache.evictions,
        "cow_copies": cache.cow_copies,
        "num_sequences": cache.num_sequences,
    }


async def _prefixes_json(state: ServerState, cache: CacheStats,
                         with_text: bool) -> list[dict[str, Any]]:
    prefixes = []
    for prefix in cache.top_prefixes[:TOP_PREFIXES]:
        entry: dict[str, Any] = {"num_tokens": prefix.num_tokens, "num_sharers": prefix.num_sharers}
        if with_text:
            entry["text"] = preview(await state.tokenization.decode(prefix.token_ids))
        prefixes.append(entry)
    return prefixes


def engine_json(engine: EngineStats) -> dict[str, Any]:
    return {
        "num_running": engine.num_running,
        "num_waiting": engine.num_waiting,
        "max_waiting": engine.max_waiting,
        "prefill_tokens_computed": engine.prefill_tokens_computed,
        "decode_tokens": engine.decode_tokens,
        "num_preemptions": engine.num_preemptions,
        "kernel_backend": engine.kernel_backend,
        "device": engine.device,
        "dtype": engine.dtype,
        "kv_dtype": engine.kv_dtype,
        "spec_drafts": engine.spec_drafts,
        "spec_draft_tokens": engine.spec_draft_tokens,
        "spec_accepted_tokens": engine.spec_accepted_tokens,
        "spec_acceptance_rate": round(engine.spec_accepted_tokens / engine.spec_draft_tokens, 6)
        if engine.spec_draft_tokens else 0.0,
    }


def _shared_json(state: ServerState, principal: Principal, engine: EngineStats) -> dict[str, Any]:
    """What counts every tenant at once, for those who may see all tenants."""
    out: dict[str, Any] = {}
    # what the gateway adapted in clients' requests (docs/clients.md): counted over every
    # tenant, so only the admin (or anyone, with auth off) sees them
    if principal.is_admin or not state.settings.auth_enabled:
        out["clients"] = state.clients.snapshot()
    # the second KV tier is shared by every tenant (and, in Redis, by the fleet): its
    # counters would show other tenants' traffic, so only the admin sees them
    if engine.tier is not None and principal.is_admin:
        out["tier"] = engine.tier
    return out


@router.get("/v1/cache/stats")
async def cache_stats(
    request: Request, principal: Principal = Depends(authenticate)
) -> dict[str, Any]:
    return await stats_json(server_state(request), principal, retention_policy(request))


class PinResponse(BaseModel):
    pinned: bool
    num_tokens: int
    num_pages: int
    tenant: str


class ResetResponse(BaseModel):
    num_pages_dropped: int


async def pin_prefix(
    state: ServerState, tokens: list[int], tenant: str, cache_salt: str | None, pin: bool
) -> PinResponse:
    """Pin (or unpin) the full blocks of ``tokens`` under ``tenant`` and ``cache_salt``."""
    if pin:
        result = await state.engine.pin(tokens, tenant, cache_salt)
    else:
        result = await state.engine.unpin(tokens, tenant, cache_salt)
    return PinResponse(
        pinned=pin, num_tokens=result.num_tokens, num_pages=result.num_pages, tenant=tenant
    )


@router.post("/v1/cache/reset")
async def reset(request: Request, _: Principal = Depends(require_admin)) -> ResetResponse:
    """Drop every unreferenced cached page (pinned pages stay)."""
    engine = server_state(request).engine
    # Takes the engine lock (held during a step): off the event loop.
    return ResetResponse(num_pages_dropped=await asyncio.to_thread(engine.reset_cache))
