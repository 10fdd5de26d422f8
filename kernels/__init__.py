"""Paged-attention kernels: Triton on CUDA, plain torch on CPU. Knows nothing of the gateway.

Public API (layout in kernels/layout.py):
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    copy_pages(kv_pool, src, dst)
    backend_name(device) -> "triton" | "torch"
"""

from kernels.layout import allocate_kv_pool, page_bytes
from kernels.reference import copy_pages_ref as copy_pages
from kernels.reference import paged_attention_ref as paged_attention
from kernels.reference import write_kv_ref as write_kv


def backend_name(device) -> str:  # replaced by kernels/dispatch.py
    return "torch"


__all__ = [
    "allocate_kv_pool",
    "backend_name",
    "copy_pages",
    "page_bytes",
    "paged_attention",
    "write_kv",
]
