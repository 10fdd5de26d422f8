"""The tensors one forward pass reads: flat tokens, the attention addressing, and the step's
kernel backend bound to that addressing."""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixgate.kernels import AttentionPlan, StepAttention


class RecurrentBatch(NamedTuple):
    """A hybrid model's state addressing for one step (models/qwen3_5.py): which state slot
    each sequence reads and updates, and where the checkpoints the cache asked for go."""

    slots: torch.Tensor  # [S] int64, the working slot of each sequence of the step
    query_start_loc: list[int]  # S + 1 host ints (the recurrence walks each sequence's rows)
    save_rows: list[int]  # P host ints, sorted: rows after which the state is checkpointed
    save_slots: torch.Tensor  # [P] int64, the checkpoint slot of each save row


class ForwardBatch(NamedTuple):
    """One step's flat batch (prefill chunks and decode tokens mixed), on the model's device.

    Layout of the attention fields: see ``kernels/layout.py``.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset
    block_tables: torch.Tensor  # [S, max_pages] int32
    seq_lens: torch.Tensor  # [S] int32, context length after this step
    query_start_loc: torch.Tensor  # [S + 1] int32
    logits_indices: torch.Tensor  # [N] int64, rows of T whose next-token logits are wanted
    max_query_len: int  # host-side max rows of one sequence (1 = pure decode step)
    # the kernel backend bound to this step's addressing (kernels/backend.py): every layer
    # calls attention.forward(q, k, v, k_cache, v_cache, scale)
    attention: StepAttention
    # hybrid models: the state slots of the step's sequences (None for attention-only models)
    recurrent: RecurrentBatch | None = None

    @property
    def attention_plan(self) -> AttentionPlan | None:
        """The torch backend's step plan (None on a backend that plans nothing)."""
        return getattr(self.attention, "plan", None)
