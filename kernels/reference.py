"""Plain-torch reference ops over the paged KV layout (see kernels/layout.py).

These run in production on CPU and are the test oracle for the Triton kernels, so they are
exact (no approximations beyond the dtype) and reasonably fast:

* decode rows (``n_s == 1``) of all sequences go through ONE padded page gather + masked SDPA
  per chunk of sequences (sorted by context length so padding stays small), not a Python
  loop per sequence;
* prefill chunks (``n_s > 1``) use SDPA per sequence with a lower-right causal bias (the
  flash path skips the masked half) and ``enable_gqa`` (K/V never expanded per query head);
* decode folds each GQA group into SDPA's row dim; both gather pages into reused buffers
  (kernels/workspace.py) read by SDPA as strided views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.checks import check_attention_inputs, check_copy_inputs, check_write_inputs
from kernels.workspace import gather_pages

# Upper bound on elements of one gathered K (or V) chunk in the batched decode path: big
# enough that a whole CPU decode batch is usually one chunk, small enough that the reused
# gather buffers (kernels/workspace.py) stay modest (16 Mi elements = 64 MB in fp32).
DECODE_GATHER_BUDGET = 1 << 24


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Scatter each new token's K/V into its slot (``slot = page * page_size + offset``)."""
    check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32, context length after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new query rows over its paged context."""
    check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    # dense rows even when query is a strided view (q sliced out of a fused qkv)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    # one host copy of the small metadata; everything below indexes with Python ints
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_seqs: list[int] = []
    for s, ctx_len in enumerate(lens):
        n_new = starts[s + 1] - starts[s]
        if n_new < 0 or n_new > ctx_len:
            raise ValueError(
                f"sequence {s}: {n_new} new query rows but context length {ctx_len} "
                "(query_start_loc must be non-decreasing and rows <= seq_lens)"
            )
        if n_new == 1:
            decode_seqs.append(s)
        elif n_new > 1:
            out[starts[s] : starts[s + 1]] = _prefill_one(
                query[starts[s] : starts[s + 1]], k_cache, v_cache, block_tables[s], ctx_len, scale
            )
    if decode_seqs:
        # longest first, so each chunk pads to a similar length
        decode_seqs.sort(key=lambda s: lens[s], reverse=True)
        per_token = k_cache.shape[2] * k_cache.shape[3]
        chunk: list[int] = []
        for s in decode_seqs:
            # chunk[0] is the longest of the chunk, so it sets the padded length
            padded = lens[chunk[0]] if chunk else lens[s]
            if chunk and (len(chunk) + 1) * padded * per_token > DECODE_GATHER_BUDGET:
                _decode_batch(
                    out, query, k_cache, v_cache, block_tables, chunk, starts, lens, scale
                )
                chunk = []
            chunk.append(s)
        _decode_batch(out, query, k_cache, v_cache, block_tables, chunk, starts, lens, scale)
    return out


def _gather_context(
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [B, n_pages] int64, valid page ids
    ctx_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [B, Hkv, ctx_len, D] (strided views)
    batch, n_pages = pages.shape
    flat = pages.reshape(-1)
    k = gather_pages(k_cache, flat, "k").view(batch, n_pages * k_cache.shape[1], *k_cache.shape[2:])
    v = gather_pages(v_cache, flat, "v").view(batch, n_pages * v_cache.shape[1], *v_cache.shape[2:])
    # SDPA takes the head-major view as is: no transposing copy
    return k[:, :ctx_len].transpose(1, 2), v[:, :ctx_len].transpose(1, 2)


def _prefill_one(
    q: torch.Tensor,  # [n, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_pages] int32
    ctx_len: int,
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    page_size = k_cache.shape[1]
    n_new = q.shape[0]
    pages = block_table[: (ctx_len + page_size - 1) // page_size].long()
    k, v = _gather_context(k_cache, v_cache, pages[None], ctx_len)  # [1, Hkv, C, D]
    q_heads = q.to(k.dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
    # Row j sits at position ctx_len - n_new + j and sees keys 0..that position: a causal mask
    # aligned to the lower right. Passing it as a causal bias (not a materialised boolean mask)
    # lets SDPA's CPU flash kernel skip the masked half instead of converting an [n, C] mask.
    if n_new == ctx_len:
        o = F.scaled_dot_product_attention(q_heads, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        bias = causal_lower_right(n_new, ctx_len)
        o = F.scaled_dot_product_attention(q_heads, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def _decode_batch(
    out: torch.Tensor,  # [T, Hq, D], written at the decode rows
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    scale: float,
) -> None:
    """One padded gather + masked SDPA for the single query row of each sequence in ``seqs``."""
    device = query.device
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    batch = len(seqs)
    seq_idx = torch.tensor(seqs, device=device)
    rows = torch.tensor([starts[s] for s in seqs], device=device)
    ctx_lens = [lens[s] for s in seqs]
    max_ctx = max(ctx_lens)
    ctx = torch.tensor(ctx_lens, device=device)  # [B]
    n_pages = (max_ctx + page_size - 1) // page_size
    pages = block_tables[seq_idx, :n_pages].long()  # [B, n_pages]
    # NOTE: entries past a sequence's last page are unspecified (may be -1 or stale): point
    # them at page 0 so the gather is in bounds; the key mask below hides what they hold.
    page_pos = torch.arange(n_pages, device=device) * page_size
    pages = torch.where(page_pos[None, :] < ctx[:, None], pages, 0)
    k, v = _gather_context(k_cache, v_cache, pages, max_ctx)  # [B, Hkv, C, D]
    # the GQA group as G query rows per KV head: decode needs no causal mask, only padding's
    q = query[rows].to(k.dtype).view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    mask = None
    if min(ctx_lens) < max_ctx:
        mask = (torch.arange(max_ctx, device=device)[None, :] < ctx[:, None])[:, None, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, D]
    out[rows] = o.reshape(batch, num_q_heads, head_dim).to(out.dtype)


def copy_pages_ref(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages (every layer, K and V): ``kv_pool[:, :, dst] = kv_pool[:, :, src]``."""
    check_copy_inputs(kv_pool, src, dst)
    if src.numel() == 0:
        return
    kv_pool[:, :, dst] = kv_pool[:, :, src]
