"""Paged-attention kernels: Triton on CUDA, plain torch on CPU. Knows nothing of the gateway.

Public API (layout in kernels/layout.py; backend choice in kernels/dispatch.py):
    write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None, native=False,
             check=True)
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    *, max_query_len=None, backend=None, plan=None, check=True) -> [T, Hq, D]
    plan_attention(block_tables, seq_lens, query_start_loc, *, page_size, kv_row_elems, ...)
        -> AttentionPlan (torch backend: one step's addressing, planned once for all layers)
    copy_pages(kv_pool, src, dst, *, backend=None)
    backend_name(device, backend=None) -> "triton" | "torch"
    native_decode_available() / native_status(): the native CPU library (kernels/csrc/*.c,
        kernels/native_lib.py): the decode and prefill attention kernels the torch backend
        uses for fp32 rows (kernels/native.py, kernels/native_prefill.py) and fused per-token
        layer ops (kernels/native_ops.py: RMSNorm, SiLU-and-multiply, in-place RoPE, the K/V
        scatter, the linear layer)

``triton`` is optional: it is imported only when the Triton backend is first used.
"""

from prefixgate.kernels.attention_plan import AttentionPlan, plan_attention
from prefixgate.kernels.dispatch import (
    BACKEND_ENV,
    backend_name,
    copy_pages,
    paged_attention,
    write_kv,
)
from prefixgate.kernels.layout import allocate_kv_pool, page_bytes
from prefixgate.kernels.native import native_decode_available, native_status

__all__ = [
    "BACKEND_ENV",
    "AttentionPlan",
    "allocate_kv_pool",
    "backend_name",
    "copy_pages",
    "native_decode_available",
    "native_status",
    "page_bytes",
    "paged_attention",
    "plan_attention",
    "write_kv",
]
