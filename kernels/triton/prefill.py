"""Triton kernel: prefix-prefill attention over the paged cache (n_s > 1 new rows per sequence).

Layout::

    query           : [T, Hq, D]                        last dim dense; Hq = Hkv * GROUP_SIZE
    k_cache, v_cache: [num_pages, page_size, Hkv, D]    same strides, last dim dense
    block_tables    : [S, max_pages] int32
    seq_lens        : [S] int32   (context length after this step: cached prefix + new rows)
    query_start_loc : [S + 1] int32
    out             : [T, Hq, D]

Grid: (T // BLOCK_Q + S, Hkv). A program takes a tile of BLOCK_Q consecutive new tokens of one
sequence and one KV head, and flattens (token, query head of the group) into BLOCK_M rows
(row m = token m // GROUP_SIZE, head m % GROUP_SIZE), so K/V tiles are loaded once for the
whole GQA group. The new tokens' own K/V were written to the pages first, so one loop over the
pages covers the cached prefix and the causal part alike: row m sees key positions
``0 .. seq_lens - n_s + token``.

Tile ids are mapped to sequences without any host sync: sequence s owns tile ids starting at
``query_start_loc[s] // BLOCK_Q + s`` (one slack tile per sequence makes the ranges disjoint);
a program binary-searches that and exits when its tile is past the sequence's rows. Decode
sequences (n_s == 1) exit too: they belong to the split-K decode kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from prefixgate.kernels.checks import AttentionShapes
from prefixgate.kernels.triton.common import (
    compute_dtype,
    dot_precision,
    require_inner_contiguous,
)

# Flattened (token, head) rows per program: 128 rows x 8 warps feed Hopper's wgmma well on long
# chunks (184 registers, no spills at D=128 bf16, checked offline for sm_90); batches of short
# chunks take 64 x 4 so fewer rows are padding.
PREFILL_BLOCK_M_LONG = 128
PREFILL_BLOCK_M_SHORT = 64
PREFILL_BLOCK_N = 64  # keys per loop iteration


# Per-step scalars stay runtime values (one compiled kernel however the batch changes); for
# num_seqs it also matters for correctness of compilation: Triton turns an int equal to 1 into
# a constant, which could not be the loop-carried bound of the binary search.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_s", "window"])
def _paged_prefill_kernel(
    query_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    block_tables_ptr,  # [S, max_pages] int32
    seq_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # [Hq] fp32 attention-sink logits (HAS_SINKS)
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    window,  # WINDOWED: a row sees only the last `window` positions, itself included
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_h,
    stride_bt_s,
    GROUP_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per tile; BLOCK_Q * GROUP_SIZE <= BLOCK_M
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # each head's softmax has one more term, attending nothing
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # the last sequence whose first tile id is <= tile
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if num_new <= 1:
        return  # a decode sequence (or none): the decode kernel's
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= num_new:
        return  # slack tile
    ctx_len = tl.load(seq_lens_ptr + seq)
    first_pos = ctx_len - num_new  # position of the sequence's first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tokens = tile_in_seq * BLOCK_Q + offs_m // GROUP_SIZE  # [BLOCK_M] index among new rows
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M] query head
    row_mask = (offs_m < BLOCK_Q * GROUP_SIZE) & (tokens < num_new)
    d_mask = offs_d < HEAD_DIM
    q_pos = first_pos + tokens  # [BLOCK_M] position each row sits at

    rows = (q_start + tokens).to(tl.int64)
    q = tl.load(
        query_ptr + rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(COMPUTE_DTYPE)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_off = kv_head * stride_cache_h
    # keys up to the tile's last row; rows are causal within it
    last_token = tl.minimum(tile_in_seq * BLOCK_Q + BLOCK_Q, num_new) - 1
    kv_end = first_pos + last_token + 1
    kv_begin = 0
    if WINDOWED:  # from the first window of the tile's first row
        kv_begin = tl.maximum(first_pos + tile_in_seq * BLOCK_Q - window + 1, 0)

    for start in range(kv_begin, kv_end, BLOCK_N):
        toks = start + offs_n  # [BLOCK_N] key positions
        tok_mask = toks < kv_end
        pages = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
        kv_off = pages * stride_cache_page + (toks % PAGE_SIZE) * stride_cache_slot + head_off
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(COMPUTE_DTYPE)), input_precision=DOT_PRECISION)
        scores = scores * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (toks[None, :] <= q_pos[:, None]) & tok_mask[None, :]
        if WINDOWED:
            visible = visible & (toks[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # key 0 is visible to every row in the first iteration, so m_i is finite from then on
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = m_new
        if WINDOWED:  # a later row may see no key of an early iteration: exp2 of 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - m_i)
    tl.store(
        out_ptr + rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_triton(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], rows of prefill sequences are written
    shapes: AttentionShapes,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits (gpt-oss)
) -> None:
    """Attention for every sequence with n_s > 1 new rows (prefix from pages + causal new part).

    Arguments are validated by the caller (``paged_attention_triton``), which passes ``shapes``.
    ``window``: each row sees only the last ``window`` positions (a sliding layer).
    """
    require_inner_contiguous(query, out, block_tables)
    if shapes.num_seqs == 0 or shapes.num_tokens == 0:
        return
    group = shapes.group_size
    # mean flattened rows per sequence, from shapes alone (no sync)
    long_chunks = shapes.num_tokens * group >= PREFILL_BLOCK_M_LONG * shapes.num_seqs
    block_m = PREFILL_BLOCK_M_LONG if long_chunks else PREFILL_BLOCK_M_SHORT
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_tiles = shapes.num_tokens // block_q + shapes.num_seqs
    _paged_prefill_kernel[(num_tiles, shapes.num_kv_heads)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        sinks if sinks is not None else out,  # (any pointer when HAS_SINKS is off)
        scale * math.log2(math.e), shapes.num_seqs, window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP_SIZE=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=shapes.head_dim,
        BLOCK_D=triton.next_power_of_2(shapes.head_dim),
        PAGE_SIZE=shapes.page_size,
        BLOCK_N=PREFILL_BLOCK_N,
        WINDOWED=window is not None,
        HAS_SINKS=sinks is not None,
        COMPUTE_DTYPE=compute_dtype(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2,
    )
