"""models/moe.py: the routed MLP against computing every expert densely, and only the chosen
experts touched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixgate.gateway.engine.models.moe import MoEMLP

EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 16, 8


def _moe(seed: int = 0) -> MoEMLP:
    torch.manual_seed(seed)
    return MoEMLP(
        torch.randn(EXPERTS, HIDDEN), torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.3,
        torch.randn(EXPERTS, HIDDEN, INTER) * 0.3, top_k=TOP_K, normalize=True,
    )  # fmt: skip


def _dense(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    probs = F.linear(x, moe.router).softmax(-1)
    weights, chosen = probs.topk(TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(EXPERTS):
        gate_up = F.linear(x, moe.gate_up[e])
        y = F.linear(F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], moe.down[e])  # [T, H]
        weight = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 where e was not chosen
        out += weight * y
    return out


def test_routed_mlp_equals_dense_mixture():
    moe = _moe()
    x = torch.randn(23, HIDDEN)
    torch.testing.assert_close(moe(x), _dense(moe, x))


def test_unchosen_experts_are_never_computed():
    moe = _moe(1)
    x = torch.randn(5, HIDDEN)
    _, chosen = moe.route(x)
    unused = sorted(set(range(EXPERTS)) - set(chosen.flatten().tolist()))
    assert unused
    before = moe(x)
    moe.gate_up[unused] = float("nan")  # any read of these would poison the output
    moe.down[unused] = float("nan")
    assert torch.equal(moe(x), before)
