"""A mixture-of-experts MLP (Qwen3-MoE): router top-k, then only the chosen experts compute.

The step's (token, expert) choices are sorted by expert, so each expert runs one GEMM over all
the step's tokens routed to it (prefill rows and decode rows alike) and experts nobody chose
cost nothing. Routing follows transformers: softmax in fp32 over all experts, top-k, optional
renormalisation of the k weights, each expert's output scaled by its weight and summed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixgate.kernels.layer_ops import grouped_by_expert
from prefixgate.kernels.quant import QuantizedTensor

# x [n, in] -> [n, out]: a Linear (models/linear.py), or any callable computing one
Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StackedExperts:
    """Experts' matrices still in ggml blocks, one ``[I, H]`` QuantizedTensor per expert, read
    as the stacked ``[E, I, H]`` weight they are (``shape``; ``dequantize()``)."""

    parts: tuple[QuantizedTensor, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.parts), *self.parts[0].shape)

    def dequantize(self) -> torch.Tensor:
        return torch.stack([part.dequantize() for part in self.parts])

    @classmethod
    def from_rows(cls, stacked: QuantizedTensor, num_experts: int) -> StackedExperts:
        """Split an ``[E * I, H]`` block matrix into its experts (whole rows of blocks)."""
        rows = stacked.shape[0] // num_experts
        return cls(tuple(
            QuantizedTensor(stacked.qtype, stacked.data[e * rows : (e + 1) * rows].clone(),
                            (rows, stacked.shape[1]))
            for e in range(num_experts)
        ))  # fmt: skip


class MoEMLP:
    """Args:
    router: ``[E, H]``.
    experts: per expert ``(gate_up, down)``: ``H -> 2I`` (gate rows first) and ``I -> H``.
    top_k: experts per token; normalize: renormalise the top-k weights to sum to 1.
    """

    def __init__(
        self,
        router: torch.Tensor,
        experts: Sequence[tuple[Projection, Projection]],
        *,
        top_k: int,
        normalize: bool,
    ) -> None:
        self.router = router
        self.experts = list(experts)
        self.top_k = top_k
        self.normalize = normalize
        self.num_experts = router.shape[0]

    @classmethod
    def from_stacked(
        cls, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **kwargs: object
    ) -> MoEMLP:
        """From stacked tensors: ``gate_up [E, 2I, H]``, ``down [E, H, I]`` (plain matmuls)."""
        experts = [
            (lambda x, w=gate_up[e]: F.linear(x, w), lambda x, w=down[e]: F.linear(x, w))
            for e in range(router.shape[0])
        ]
        return cls(router, experts, **kwargs)  # type: ignore[arg-type]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ``(weights [T, k] in x's dtype, experts [T, k] int64)`` for ``x [T, H]``."""
        probs = F.linear(x, self.router).float().softmax(-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        return grouped_by_expert(x, weights, experts, self.num_experts, self._expert)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        gate_up_proj, down_proj = self.experts[expert]
        gate_up = gate_up_proj(x)  # [n, 2I]
        inter = gate_up.shape[1] // 2
        return down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)`` (the decoder's residual step, as for a dense MLP)."""
        return residual + self(x)


class GroupedMoEMLP(MoEMLP):
    """The same routing, the experts stacked and computed by the kernel backend's grouped op
    (``kernels.moe_experts_op``: on Triton one grouped GEMM over the tokens sorted by expert).

    Args:
        router: ``[E, H]``; gate_up: ``[E, 2I, H]``; down: ``[E, H, I]``; op: the bound op.
    """

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        op: Callable[..., torch.Tensor],
        *,
        top_k: int,
        normalize: bool,
    ) -> None:
        super().__init__(router, [], top_k=top_k, normalize=normalize)
        self.gate_up, self.down, self.op = gate_up, down, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        return self.op(x, self.gate_up, self.down, weights, experts)


__all__ = ["GroupedMoEMLP", "MoEMLP", "StackedExperts"]
