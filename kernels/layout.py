"""The one place the paged KV layout is defined.

KV pool (all layers, one tensor so a copy-on-write copies every layer at once)::

    kv_pool: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
             layer l's K cache = kv_pool[l, 0], V cache = kv_pool[l, 1]
             each: [num_pages, page_size, num_kv_heads, head_dim], contiguous

Addressing::

    slot          = page_id * page_size + offset_in_page      (int64; -1 = skip this token)
    slot_mapping  : [num_tokens]            int64, where each new token's K/V is written
    block_tables  : [num_seqs, max_pages]   int32, logical block i of seq s -> physical page id
                                            (entries past a sequence's last page are ignored)
    seq_lens      : [num_seqs]              int32, context length AFTER this step (cached + new)
    query_start_loc: [num_seqs + 1]         int32, cu_seqlens of the flat query tokens

A flat batch mixes prefill chunks and decode tokens: sequence s owns query rows
``query_start_loc[s]:query_start_loc[s+1]`` (n_s rows); those are its LAST n_s positions, i.e.
query row j of s sits at position ``seq_lens[s] - n_s + j`` and attends causally to positions
``0 .. seq_lens[s] - n_s + j`` read from the pages (its own K/V was written there first).
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.host_memory import empty_huge


def allocate_kv_pool(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate the KV pool ``[L, 2, num_pages, page_size, Hkv, D]`` (zero-filled; on CPU in
    huge pages where available: decode attention reads it from scattered pages)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        return empty_huge(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def page_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one physical page occupies across all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize
