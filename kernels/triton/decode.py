"""Triton kernel: paged decode attention (one query row per sequence), GQA-grouped, split-K.

Layout::

    query           : [T, Hq, D]                        last dim dense; Hq = Hkv * GROUP_SIZE
    k_cache, v_cache: [num_pages, page_size, Hkv, D]    same strides, last dim dense
    block_tables    : [S, max_pages] int32
    seq_lens        : [S] int32   (context length, the new token included)
    query_start_loc : [S + 1] int32
    out             : [T, Hq, D]
    partial_out     : [S, Hq, num_splits, D] fp32   un-normalised P @ V of each split
    partial_max     : [S, Hq, num_splits]    fp32   running max of each split (log2 domain)
    partial_sum     : [S, Hq, num_splits]    fp32   softmax denominator of each split

Grid: (S, Hkv, num_splits). A program takes one KV head of one sequence and one contiguous
range of ``pages_per_split`` pages, and computes attention for ALL ``GROUP_SIZE`` query heads
that share that KV head, so each K/V byte is read from memory once (decode is bandwidth-bound:
the [GROUP, BLOCK_N] score tile is padded to 16 rows only to feed ``tl.dot``). Sequences whose
query has n_s != 1 rows are skipped: they belong to the prefill kernel.

Without SPLIT_K (one split) the program normalises and writes ``out`` itself; with it, it
writes partials and ``decode_reduce`` merges them (flash-decoding), which keeps all
SMs busy when ``S * Hkv`` alone would leave most of them idle on long contexts.

The split count and the other per-step scalars are runtime arguments kept out of Triton's
value specialisation, so a serving loop whose batch shape changes every step reuses one
compiled kernel instead of JIT-compiling a variant per shape.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from prefixgate.kernels.checks import AttentionShapes, require
from prefixgate.kernels.triton.common import (
    compute_dtype,
    device_sms,
    dot_precision,
    require_inner_contiguous,
)
from prefixgate.kernels.triton.decode_reduce import decode_reduce_triton

# Tokens one loop iteration reads (a multiple of the page size when pages are smaller).
DECODE_BLOCK_N = 64
# Aim for this many programs per SM so the last wave is a small fraction of the work.
PROGRAMS_PER_SM = 16
# A split shorter than this spends more on its partial write + reduce than it saves.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


class DecodeSplitPlan(NamedTuple):
    """How the context of every sequence is cut for split-K decode."""

    num_splits: int  # programs per (sequence, KV head)
    pages_per_split: int  # pages each of them covers (the last one may cover fewer)


def plan_decode_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_pages: int,
    page_size: int,
    num_sms: int,
    pages_per_split: int | None = None,
) -> DecodeSplitPlan:
    """Pick the split-K plan from the batch shape alone (never reads sequence lengths, no sync).

    ``max_pages`` (the block table width) bounds every context. ``pages_per_split`` forces a
    split size (tests use it to exercise many splits on tiny contexts).
    """
    max_pages = max(max_pages, 1)
    if pages_per_split is None:
        pages_per_block = max(DECODE_BLOCK_N // page_size, 1)
        wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(num_seqs * num_kv_heads, 1))
        most = max(math.ceil(max_pages * page_size / MIN_TOKENS_PER_SPLIT), 1)
        splits = max(min(wanted, most, MAX_SPLITS), 1)
        pages_per_split = math.ceil(max_pages / splits)
        # whole loop iterations per split, so no iteration straddles two splits
        pages_per_split = math.ceil(pages_per_split / pages_per_block) * pages_per_block
    require(pages_per_split >= 1, f"pages_per_split must be >= 1, got {pages_per_split}")
    return DecodeSplitPlan(math.ceil(max_pages / pages_per_split), pages_per_split)


@triton.jit(do_not_specialize=["pages_per_split", "num_splits", "stride_bt_s", "window"])
def _paged_decode_kernel(
    query_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    block_tables_ptr,  # [S, max_pages] int32
    seq_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    out_ptr,  # [T, Hq, D]                          (not SPLIT_K)
    partial_out_ptr,  # [S, Hq, num_splits, D] fp32  (SPLIT_K)
    partial_max_ptr,  # [S, Hq, num_splits] fp32
    partial_sum_ptr,  # [S, Hq, num_splits] fp32
    sinks_ptr,  # [Hq] fp32 attention-sink logits (HAS_SINKS)
    scale_log2,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper)
    pages_per_split,
    num_splits,
    window,  # WINDOWED: the row sees only the last `window` positions, itself included
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_h,
    stride_bt_s,
    NUM_Q_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (tl.dot minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # each head's softmax has one more term, attending nothing
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return  # not a decode sequence
    ctx_len = tl.load(seq_lens_ptr + seq)
    tok_begin = split * pages_per_split * PAGE_SIZE
    if tok_begin >= ctx_len:
        return  # past this sequence's context; the reduce ignores the split
    tok_end = tl.minimum(tok_begin + pages_per_split * PAGE_SIZE, ctx_len)
    if WINDOWED:
        # a split wholly before the window holds nothing visible (the reduce skips it too)
        win_begin = tl.maximum(ctx_len - window, 0)
        if tok_end <= win_begin:
            return
        tok_begin = tl.maximum(tok_begin, win_begin)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G] query heads of this KV head
    g_mask = offs_g < GROUP_SIZE
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        query_ptr + q_row * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_off = kv_head * stride_cache_h

    for start in range(tok_begin, tok_end, BLOCK_N):
        toks = start + offs_n  # [BLOCK_N] positions in the sequence
        tok_mask = toks < tok_end
        pages = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
        kv_off = pages * stride_cache_page + (toks % PAGE_SIZE) * stride_cache_slot + head_off
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(COMPUTE_DTYPE)), input_precision=DOT_PRECISION)
        scores = scores * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(tok_mask[None, :], scores, float("-inf"))
        # every iteration holds >= 1 valid key, so m_new is finite and no row goes NaN
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT_K:
        if HAS_SINKS:  # (the split-K reduce adds the sink once, after the merge)
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - m_i)
        tl.store(
            out_ptr + q_row * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = (seq.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(partial_max_ptr + part, m_i, mask=g_mask)
        tl.store(partial_sum_ptr + part, l_i, mask=g_mask)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


def paged_decode_triton(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], rows of decode sequences are written
    shapes: AttentionShapes,
    pages_per_split: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits (gpt-oss)
) -> DecodeSplitPlan:
    """Decode attention for every sequence with exactly one query row; returns the split plan.

    Arguments are validated by the caller (``paged_attention_triton``), which passes ``shapes``.
    ``window``: each row sees only the last ``window`` positions (a sliding layer).
    """
    require_inner_contiguous(query, out, block_tables)
    plan = plan_decode_splits(shapes.num_seqs, shapes.num_kv_heads, shapes.max_pages_per_seq,
                              shapes.page_size, device_sms(query.device), pages_per_split)
    if shapes.num_seqs == 0:
        return plan
    partial_out, partial_max, partial_sum = _split_partials(out, shapes, plan)
    block_n = max(DECODE_BLOCK_N, triton.next_power_of_2(shapes.page_size))
    grid = (shapes.num_seqs, shapes.num_kv_heads, plan.num_splits)
    _paged_decode_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, partial_out, partial_max, partial_sum, sinks if sinks is not None else out,
        scale * math.log2(math.e), plan.pages_per_split, plan.num_splits, window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=shapes.num_q_heads,
        GROUP_SIZE=shapes.group_size,
        BLOCK_G=max(16, triton.next_power_of_2(shapes.group_size)),
        HEAD_DIM=shapes.head_dim,
        BLOCK_D=triton.next_power_of_2(shapes.head_dim),
        PAGE_SIZE=shapes.page_size,
        BLOCK_N=block_n,
        SPLIT_K=plan.num_splits > 1,
        WINDOWED=window is not None,
        HAS_SINKS=sinks is not None,
        COMPUTE_DTYPE=compute_dtype(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=4,
        num_stages=2,
    )
    if plan.num_splits > 1:
        decode_reduce_triton(partial_out, partial_max, partial_sum, seq_lens, query_start_loc,
                             out, plan.pages_per_split, shapes.page_size, window, sinks)
    return plan


def _split_partials(
    out: torch.Tensor, shapes: AttentionShapes, plan: DecodeSplitPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's partial output, running max and sum (fp32), for the reduce to merge."""
    if plan.num_splits <= 1:  # never read: the kernel writes `out` directly
        return out, out, out
    partial_out = torch.empty(
        (shapes.num_seqs, shapes.num_q_heads, plan.num_splits, shapes.head_dim),
        dtype=torch.float32, device=out.device,
    )
    partial_max = torch.empty(partial_out.shape[:3], dtype=torch.float32, device=out.device)
    return partial_out, partial_max, torch.empty_like(partial_max)
