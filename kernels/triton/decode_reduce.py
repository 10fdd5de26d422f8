"""Triton kernel: merge the split-K partial results of paged decode (flash-decoding reduce).

Layout::

    partial_out     : [S, Hq, num_splits, D] fp32   un-normalised P @ V of each split
    partial_max     : [S, Hq, num_splits]    fp32   max score of each split (log2 domain)
    partial_sum     : [S, Hq, num_splits]    fp32   sum of exp2(score - max) of each split
    seq_lens        : [S] int32
    query_start_loc : [S + 1] int32
    out             : [T, Hq, D]

Grid: (S, Hq). Only the splits that start inside a sequence's context were written; the
others hold garbage and are masked out here from ``seq_lens`` (same arithmetic as the decode
kernel's early exit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# per-step scalars stay runtime values: one compiled kernel per BLOCK_SPLITS, not per shape
@triton.jit(do_not_specialize=["tokens_per_split", "num_splits", "window"])
def _decode_reduce_kernel(
    partial_out_ptr,  # [S, Hq, num_splits, D] fp32
    partial_max_ptr,  # [S, Hq, num_splits] fp32
    partial_sum_ptr,  # [S, Hq, num_splits] fp32
    seq_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # [Hq] fp32 attention-sink logits (HAS_SINKS)
    tokens_per_split,
    num_splits,
    window,  # WINDOWED: splits wholly before the last `window` positions were skipped
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return  # not a decode sequence
    ctx_len = tl.load(seq_lens_ptr + seq)
    num_valid = tl.cdiv(ctx_len, tokens_per_split)

    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_valid
    if WINDOWED:
        s_mask = s_mask & (offs_s >= tl.maximum(ctx_len - window, 0) // tokens_per_split)
    d_mask = offs_d < HEAD_DIM
    part = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + offs_s  # [BLOCK_SPLITS]

    split_max = tl.load(partial_max_ptr + part, mask=s_mask, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + part, mask=s_mask, other=0.0)
    # the first valid split always holds >= 1 key, so m_max is finite and unwritten splits
    # weigh 0
    m_max = tl.max(split_max, 0)
    weight = tl.where(s_mask, tl.exp2(split_max - m_max), 0.0)  # [BLOCK_SPLITS]
    denom = tl.sum(weight * split_sum, 0)
    if HAS_SINKS:  # one more softmax term, attending nothing (scores are in the log2 domain)
        denom += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - m_max)
    acc = tl.load(
        partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_SPLITS, BLOCK_D]
    merged = tl.sum(acc * weight[:, None], 0) / denom  # [BLOCK_D]
    tl.store(
        out_ptr + q_row * stride_o_t + head * stride_o_h + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_reduce_triton(
    partial_out: torch.Tensor,  # [S, Hq, num_splits, D] fp32
    partial_max: torch.Tensor,  # [S, Hq, num_splits] fp32
    partial_sum: torch.Tensor,  # [S, Hq, num_splits] fp32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    out: torch.Tensor,  # [T, Hq, D]
    pages_per_split: int,
    page_size: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge decode partials into the decode sequences' ``out`` rows (``window``: as the decode
    kernel was given it)."""
    num_seqs, num_q_heads, num_splits, head_dim = partial_out.shape
    for name, tensor in (
        ("partial_out", partial_out),
        ("partial_max", partial_max),
        ("partial_sum", partial_sum),
    ):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor")
    if (
        partial_max.shape != (num_seqs, num_q_heads, num_splits)
        or partial_sum.shape != partial_max.shape
    ):
        raise ValueError(
            "partial_max/partial_sum must be [S, Hq, splits] = "
            f"{(num_seqs, num_q_heads, num_splits)}, "
            f"got {tuple(partial_max.shape)} and {tuple(partial_sum.shape)}"
        )
    if out.shape[1:] != (num_q_heads, head_dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, {num_q_heads}, {head_dim}] with a dense last dim")
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        partial_out,
        partial_max,
        partial_sum,
        seq_lens,
        query_start_loc,
        out,
        sinks if sinks is not None else out,
        pages_per_split * page_size,
        num_splits,
        window or 0,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        WINDOWED=window is not None,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
