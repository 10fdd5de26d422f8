"""Triton kernel: copy whole physical pages (every layer, K and V) for copy-on-write.

Layout::

    kv_pool : [L, 2, num_pages, page_size, Hkv, D], contiguous; seen here as
              [L * 2 planes, num_pages, PAGE_ELEMS] with PAGE_ELEMS = page_size * Hkv * D
    src, dst: [N] int64 page ids, pair i copies page src[i] onto page dst[i]

Grid: (N, L * 2, cdiv(PAGE_ELEMS, BLOCK)). Each program moves one BLOCK-sized chunk of one
page of one plane: a page of one plane is contiguous, so loads and stores are fully coalesced.

NOTE: pairs run in parallel, so a page must not be both a ``dst`` and a ``src`` in one call,
and ``dst`` ids must be distinct (copy-on-write targets are freshly allocated pages, so they
are); the torch reference has the same contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.kernels.checks import check_copy_inputs, require
from prefixgate.kernels.triton.common import check_triton_device

COPY_BLOCK = 4096  # elements per program


@triton.jit
def _copy_pages_kernel(
    kv_pool_ptr,  # [L * 2, num_pages, PAGE_ELEMS]
    src_ptr,  # [N] int64
    dst_ptr,  # [N] int64
    stride_plane,
    stride_page,
    PAGE_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # plane * stride_plane overflows int32 on big pools
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_ELEMS
    base = kv_pool_ptr + plane * stride_plane + offs
    data = tl.load(base + src * stride_page, mask=mask)
    tl.store(base + dst * stride_page, data, mask=mask)


def copy_pages_triton(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages (every layer, K and V): ``kv_pool[:, :, dst] = kv_pool[:, :, src]``."""
    check_copy_inputs(kv_pool, src, dst)
    check_triton_device(kv_pool)
    require(kv_pool.is_contiguous(), f"kv_pool must be contiguous, strides {kv_pool.stride()}")
    require(src.is_contiguous() and dst.is_contiguous(), "src and dst must be contiguous")
    num_pairs = src.shape[0]
    if num_pairs == 0:
        return
    num_layers, _, _, page_size, num_kv_heads, head_dim = kv_pool.shape
    page_elems = page_size * num_kv_heads * head_dim
    block = min(COPY_BLOCK, triton.next_power_of_2(page_elems))
    grid = (num_pairs, num_layers * 2, triton.cdiv(page_elems, block))
    _copy_pages_kernel[grid](
        kv_pool,
        src,
        dst,
        kv_pool.stride(1),
        kv_pool.stride(2),
        PAGE_ELEMS=page_elems,
        BLOCK=block,
        num_warps=4,
    )
