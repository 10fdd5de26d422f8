"""The routed experts of a mixture-of-experts MLP in plain torch (any device).

Layout (shared with kernels/triton/moe.py):
    x        [T, H]        the step's tokens
    gate_up  [E, 2I, H]    per expert, gate rows then up rows
    down     [E, H, I]
    weights  [T, k]        routing weights of each token's chosen experts (x's dtype)
    experts  [T, k] int64  the chosen experts
    out      [T, H]        sum over k of weight * down(silu(gate) * up)

Only the chosen experts compute: the step's (token, expert) choices are sorted by expert and
each expert runs one GEMM over all the tokens routed to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_by_expert(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    experts: torch.Tensor,  # [T, k] int64
    num_experts: int,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],  # (e, [n, H]) -> [n, H]
) -> torch.Tensor:  # [T, H]
    """``sum_k weights[t, k] * expert_fn(experts[t, k], x[t])``, one call per chosen expert
    over all the tokens routed to it; experts nobody chose are never called."""
    top_k = experts.shape[1]
    flat = experts.flatten()  # [T * k]
    order = flat.argsort(stable=True)  # choices grouped by expert
    token_of = order // top_k
    weight_of = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        y = expert_fn(expert, x.index_select(0, rows))  # [n, H]
        out.index_add_(0, rows, y * weight_of[start : start + count, None])
        start += count
    return out


def moe_experts_torch(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k]
    experts: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:  # [T, H]
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` (SwiGLU experts)."""

    def swiglu(expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(rows, gate_up[expert])  # [n, 2I]
        inter = hidden.shape[1] // 2
        return F.linear(F.silu(hidden[:, :inter]) * hidden[:, inter:], down[expert])

    return grouped_by_expert(x, weights, experts, gate_up.shape[0], swiglu)


__all__ = ["grouped_by_expert", "moe_experts_torch"]
