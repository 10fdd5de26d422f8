"""Plain-torch reference ops over the paged KV layout (see kernels/layout.py).

These run in production on CPU and are the test oracle for the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Scatter each new token's K/V into its slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
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
    page_size = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        n_new = q1 - q0
        if n_new == 0:
            continue
        num_pages = (ctx_len + page_size - 1) // page_size
        pages = block_tables[s, :num_pages].long()
        k = k_cache[pages].flatten(0, 1)[:ctx_len]  # [C, Hkv, D]
        v = v_cache[pages].flatten(0, 1)[:ctx_len]
        q = query[q0:q1]  # [n, Hq, D]
        # row j sits at position ctx_len - n_new + j and sees keys 0..that position
        q_pos = torch.arange(ctx_len - n_new, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, C]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype),  # [Hq, n, D]
            k.transpose(0, 1),  # [Hkv, C, D]
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out


def copy_pages_ref(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages (every layer, K and V): kv_pool[:, :, dst] = kv_pool[:, :, src]."""
    if src.numel() == 0:
        return
    kv_pool[:, :, dst.long()] = kv_pool[:, :, src.long()]
