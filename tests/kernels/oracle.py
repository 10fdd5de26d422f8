"""The test oracle: naive per-token loops in float64 over the paged KV layout.

Slow and obviously right; every backend (kernels/torch_cpu, kernels/triton, the native CPU
kernels) is tested against it, and never against another production backend alone. Also the
routed experts of an MoE MLP (kernels/torch_cpu/moe.py, kernels/triton/moe.py), token by token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tests.kernels.paged_case import PagedBatch


def naive_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token by token: ``cache[slot // page_size, slot % page_size] = row`` (slot -1: skip)."""
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = key[t].to(k_cache.dtype)
            v_cache[slot // page_size, slot % page_size] = value[t].to(v_cache.dtype)


def naive_copy_pages(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Pair by pair, every layer, K and V (``dst`` disjoint from ``src``)."""
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        kv_pool[:, :, d] = kv_pool[:, :, s]


def naive_paged_attention(batch: PagedBatch, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Per query token, per head: gather its visible keys slot by slot, softmax in float64.

    ``window``: a sliding layer, each token sees only the last ``window`` positions (itself
    included). ``sinks``: ``[Hq]`` attention-sink logits (gpt-oss), one more softmax term per
    head that attends nothing. Returns ``[T, Hq, D]`` float64.
    """
    q_all = batch.query.double().cpu()
    k_flat = batch.k_cache.double().cpu().flatten(0, 1)  # [num_slots, Hkv, D]
    v_flat = batch.v_cache.double().cpu().flatten(0, 1)
    page_size = batch.k_cache.shape[1]
    num_q_heads, num_kv_heads = q_all.shape[1], k_flat.shape[1]
    group = num_q_heads // num_kv_heads
    tables = batch.block_tables.cpu().tolist()
    starts = batch.query_start_loc.cpu().tolist()
    out = torch.zeros_like(q_all)
    for s, ctx in enumerate(batch.seq_lens.cpu().tolist()):
        n_new = starts[s + 1] - starts[s]
        for j in range(n_new):
            pos = ctx - n_new + j
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [tables[s][p // page_size] * page_size + p % page_size
                     for p in range(first, pos + 1)]
            k = k_flat[slots].repeat_interleave(group, dim=1)  # [pos + 1, Hq, D]
            v = v_flat[slots].repeat_interleave(group, dim=1)
            q = q_all[starts[s] + j]  # [Hq, D]
            scores = torch.einsum("hd,chd->hc", q, k) * batch.scale  # [Hq, C]
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().cpu()[:, None]], -1)
            probs = torch.softmax(scores, dim=-1)[:, : len(slots)]
            out[starts[s] + j] = torch.einsum("hc,chd->hd", probs, v)
    return out


def naive_moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, in float64: ``sum_k w * down(silu(gate) * up)``."""
    x, gate_up, down, weights = (t.double().cpu() for t in (x, gate_up, down, weights))
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t, chosen in enumerate(experts.cpu().tolist()):
        for j, e in enumerate(chosen):
            hidden = gate_up[e] @ x[t]  # [2I]
            act = torch.nn.functional.silu(hidden[:inter]) * hidden[inter:]
            out[t] += weights[t, j] * (down[e] @ act)
    return out
