"""Sliding-window attention over the paged KV cache (torch; any device).

A sliding layer (Gemma 3's local layers, Mistral's window) lets the token at position p see
positions ``p - window + 1 .. p``. The pages keep every token's K/V (the cache stays one pool
of whole pages, so prefix hits, copy-on-write and page sharing work as for full layers); the
window is a mask over the gathered context. Only the pages the window can reach are read: for
a sequence whose new rows start at position ``L - n``, that is ``[L - n - window + 1, L)``.

Layout as ``kernels/layout.py``: query ``[T, Hq, D]``, caches ``[num_pages, page_size, Hkv, D]``,
query head h reads KV head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import torch

from prefixgate.kernels.checks import check_attention_inputs


def paged_attention_windowed(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32, context length after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    window: int | None,
    *,
    check: bool = True,
    sinks: torch.Tensor | None = None,  # [Hq] attention-sink logits (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new rows over the last ``window`` positions (None:
    all of them; the sink layers of gpt-oss take this path too).

    Computed in fp32 whatever the pages hold; returns ``query``'s dtype.
    """
    if check:
        check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    starts = query_start_loc.tolist()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for seq, ctx_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        if starts[seq + 1] > starts[seq]:
            out[rows] = attend_window(query[rows], k_cache, v_cache, block_tables[seq], ctx_len,
                                      scale, window, sinks)
    return out


def attend_window(
    query: torch.Tensor,  # [N, Hq, D]: one sequence's new rows, the last at ctx_len - 1
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil(ctx_len / page_size)] page ids from the first token
    ctx_len: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,  # [Hq]: one more logit in each head's softmax
) -> torch.Tensor:  # [N, Hq, D]
    """One sequence's rows over its last ``window`` positions each (None: all; fp32 inside).
    A head's sink takes its share of the softmax and attends nothing (gpt-oss)."""
    num_rows = query.shape[0]
    window = window or ctx_len
    page_size = k_cache.shape[1]
    num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    first_kv = max(0, ctx_len - num_rows - window + 1)
    first_page, last_page = first_kv // page_size, (ctx_len - 1) // page_size
    pages = block_table[first_page : last_page + 1].long()
    offset = first_kv - first_page * page_size
    span = slice(offset, offset + ctx_len - first_kv)
    keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[span].float()  # [M, Hkv, D]
    values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[span].float()
    q = query.float().reshape(num_rows, num_kv_heads, group, head_dim)  # [N, Hkv, G, D]
    scores = torch.einsum("nhgd,mhd->hgnm", q, keys) * scale  # [Hkv, G, N, M]
    q_pos = torch.arange(ctx_len - num_rows, ctx_len, device=query.device)[:, None]
    k_pos = torch.arange(first_kv, ctx_len, device=query.device)[None, :]
    visible = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [N, M]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_rows, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    attended = torch.einsum("hgnm,mhd->nhgd", probs, values)  # [N, Hkv, G, D]
    return attended.reshape(num_rows, num_heads, head_dim).to(query.dtype)


__all__ = ["attend_window", "paged_attention_windowed"]
