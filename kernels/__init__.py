"""Paged-attention kernels: Triton on CUDA, plain torch on CPU. Knows nothing of the gateway.

A folder per backend, registered in kernels/dispatch.py and chosen once per runner:

    triton/     the Triton kernels (CUDA; the CPU interpreter in tests), imported on first use
    torch_cpu/  the torch backend: production on CPU, where it hands fp32 rows to cpu/
    cpu/        the native CPU kernels (C under cpu/csrc, ctypes wrappers) and huge-page memory
    (here)      what every backend shares: the backend interface (backend.py), the registry
                (dispatch.py), the registry of a model's layer ops, bound at load
                (layer_ops.py), the KV layout (layout.py), input checks (checks.py), the torch
                backend's step plan (attention_plan.py) and gather buffers (workspace.py), the
                quantized weight format (quant.py) and the grammar-mask op (token_bitmask.py)

The test oracle (naive per-token loops in float64) lives with the tests: tests/kernels/oracle.py.

Public API (layout in kernels/layout.py; backends in kernels/backend.py, kernels/dispatch.py):
    resolve_backend(device, backend=None) -> "triton" | "torch"   (once, at start-up)
    create_backend(name, kv_pool, *, native=False, share_prefixes=True) -> AttentionBackend
        backend.prepare_metadata(AttentionInputs) -> StepAttention (once per step)
        step.forward(q, k, v, k_cache, v_cache, scale) -> [T, Hq, D]   (every layer)
        backend.copy_pages(src, dst)
    moe_experts_op(name) -> op(x, gate_up, down, weights, experts): the backend's grouped
        MoE experts (kernels/torch_cpu/moe.py, kernels/triton/moe.py), bound once by the model
    register_backend(BackendSpec(...)): add a backend to the registry
    one-off ops for tests and benchmarks (resolved per call):
    write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None, native=False,
             check=True)
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    *, max_query_len=None, backend=None, plan=None, check=True) -> [T, Hq, D]
    copy_pages(kv_pool, src, dst, *, backend=None)
    plan_attention(block_tables, seq_lens, query_start_loc, *, page_size, kv_row_elems, ...)
        -> AttentionPlan (torch backend: one step's addressing, planned once for all layers)
    backend_name(device, backend=None) -> "triton" | "torch"
    native_decode_available() / native_status(): the native CPU library (kernels/cpu/csrc/*.c,
        kernels/cpu/library.py): the decode and prefill attention kernels the torch backend
        uses for fp32 rows over fp32 or bf16 pages (kernels/cpu/decode.py,
        kernels/cpu/prefill.py) and fused per-token layer ops (kernels/cpu/ops.py: RMSNorm,
        SiLU-and-multiply, in-place RoPE, the K/V scatter; kernels/cpu/linear*.py: the linear
        layers)
    kernels.layer_ops.LayerOps(KernelChoice(...), device, act_dtype): a model's norm,
        activation, RoPE and linear ops, each picked once at load (kernels/layer_ops.py)

``triton`` is optional: it is imported only when the Triton backend is first used.
"""

from prefixgate.kernels.attention_plan import AttentionPlan, plan_attention
from prefixgate.kernels.backend import AttentionBackend, AttentionInputs, StepAttention
from prefixgate.kernels.cpu.decode import native_decode_available, native_status
from prefixgate.kernels.dispatch import (
    BACKEND_ENV,
    BackendSpec,
    backend_name,
    backend_spec,
    copy_pages,
    create_backend,
    gated_delta_ops,
    moe_experts_op,
    paged_attention,
    register_backend,
    resolve_backend,
    write_kv,
)
from prefixgate.kernels.layout import allocate_kv_pool, page_bytes

__all__ = [
    "BACKEND_ENV",
    "AttentionBackend",
    "AttentionInputs",
    "AttentionPlan",
    "BackendSpec",
    "StepAttention",
    "allocate_kv_pool",
    "backend_name",
    "backend_spec",
    "copy_pages",
    "create_backend",
    "native_decode_available",
    "gated_delta_ops",
    "moe_experts_op",
    "native_status",
    "page_bytes",
    "paged_attention",
    "plan_attention",
    "register_backend",
    "resolve_backend",
    "write_kv",
]
