"""A mixture-of-experts MLP (Qwen3-MoE): router top-k, then only the chosen experts compute.

The step's (token, expert) choices are sorted by expert, so each expert runs one GEMM over all
the step's tokens routed to it (prefill rows and decode rows alike) and experts nobody chose
cost nothing. Routing follows transformers: softmax in fp32 over all experts, top-k, optional
renormalisation of the k weights, each expert's output scaled by its weight and summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MoEMLP:
    """Args:
    router: ``[E, H]``; gate_up: ``[E, 2I, H]`` (gate rows first); down: ``[E, H, I]``.
    top_k: experts per token; normalize: renormalise the top-k weights to sum to 1.
    """

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        top_k: int,
        normalize: bool,
    ) -> None:
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.top_k = top_k
        self.normalize = normalize
        self.num_experts = router.shape[0]
        self.inter = down.shape[2]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ``(weights [T, k] in x's dtype, experts [T, k] int64)`` for ``x [T, H]``."""
        probs = F.linear(x, self.router).float().softmax(-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * k]
        order = flat.argsort(stable=True)  # choices grouped by expert
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            gate_up = F.linear(x.index_select(0, rows), self.gate_up[expert])  # [n, 2I]
            act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
            y = F.linear(act, self.down[expert])  # [n, H]
            out.index_add_(0, rows, y * weight_of[start : start + count, None])
            start += count
        return out


__all__ = ["MoEMLP"]
