"""The tensors one forward pass reads: flat tokens plus the step's attention."""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixgate.kernels import StepAttention


class ForwardBatch(NamedTuple):
    """One step's flat batch (prefill chunks and decode tokens mixed), on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    logits_indices: torch.Tensor  # [N] int64, rows of T whose next-token logits are wanted
    max_query_len: int  # host-side max rows of one sequence (1 = pure decode step)
    # the kernel backend bound to this step's addressing (kernels/backend.py): every layer
    # calls attention.forward(q, k, v, k_cache, v_cache, scale)
    attention: StepAttention
