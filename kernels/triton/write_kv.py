"""Triton kernel: scatter new tokens' K/V into their cache slots.

Layout::

    key, value      : [T, Hkv, D]                       any strides, last dim dense
    k_cache, v_cache: [num_pages, page_size, Hkv, D]    same strides, last dim dense
    slot_mapping    : [T] int64, slot = page * page_size + offset, -1 = skip

Grid: one program per token; it moves that token's whole [Hkv, D] K and V tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.kernels.checks import check_write_inputs, require
from prefixgate.kernels.triton.common import check_triton_device


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_page,
    stride_cache_slot,
    stride_cache_h,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # a token whose K/V is already cached (or padding)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    key = tl.load(
        key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :],
        mask=mask,
    )
    dst = (
        page * stride_cache_page
        + offset * stride_cache_slot
        + offs_h[:, None] * stride_cache_h
        + offs_d[None, :]
    )
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Scatter each new token's K/V into its slot (Triton; same contract as ``write_kv_torch``)."""
    check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    check_triton_device(key)
    require(key.stride(-1) == 1, f"key last dim must be contiguous, strides {key.stride()}")
    require(value.stride(-1) == 1, f"value last dim must be contiguous, strides {value.stride()}")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        PAGE_SIZE=page_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
