"""Paged-attention kernels: Triton on CUDA, plain torch on CPU. Knows nothing of the gateway.

A folder per backend, behind one dispatch (kernels/dispatch.py):

    triton/   the Triton kernels (CUDA; the CPU interpreter in tests), imported on first use
    cpu/      the native CPU kernels (C under cpu/csrc, ctypes wrappers) and huge-page memory
    (here)    what every backend shares: the KV layout (layout.py), input checks (checks.py),
              the torch backend (reference.py: production on CPU, where it hands fp32 rows to
              cpu/, and the oracle the other backends are tested against) with its step plan
              (attention_plan.py) and gather buffers (workspace.py), the quantized weight
              format (quant.py) and the grammar-mask op (token_bitmask.py)

Public API (layout in kernels/layout.py; backend choice in kernels/dispatch.py):
    write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None, native=False,
             check=True)
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    *, max_query_len=None, backend=None, plan=None, check=True) -> [T, Hq, D]
    plan_attention(block_tables, seq_lens, query_start_loc, *, page_size, kv_row_elems, ...)
        -> AttentionPlan (torch backend: one step's addressing, planned once for all layers)
    copy_pages(kv_pool, src, dst, *, backend=None)
    backend_name(device, backend=None) -> "triton" | "torch"
    native_decode_available() / native_status(): the native CPU library (kernels/cpu/csrc/*.c,
        kernels/cpu/library.py): the decode and prefill attention kernels the torch backend
        uses for fp32 rows over fp32 or bf16 pages (kernels/cpu/decode.py,
        kernels/cpu/prefill.py) and fused per-token layer ops (kernels/cpu/ops.py: RMSNorm,
        SiLU-and-multiply, in-place RoPE, the K/V scatter, the linear layer)

``triton`` is optional: it is imported only when the Triton backend is first used.
"""

from prefixgate.kernels.attention_plan import AttentionPlan, plan_attention
from prefixgate.kernels.cpu.decode import native_decode_available, native_status
from prefixgate.kernels.dispatch import (
    BACKEND_ENV,
    backend_name,
    copy_pages,
    paged_attention,
    write_kv,
)
from prefixgate.kernels.layout import allocate_kv_pool, page_bytes

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
