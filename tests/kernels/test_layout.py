"""The KV pool layout helpers."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.layout import allocate_kv_pool, page_bytes


def test_pool_shape_and_page_bytes() -> None:
    pool = allocate_kv_pool(3, 10, 16, 2, 8, torch.bfloat16, "cpu")
    assert pool.shape == (3, 2, 10, 16, 2, 8) and pool.is_contiguous()
    assert not pool.any()
    # one page across all layers, K and V: the pool's size / number of pages
    assert page_bytes(3, 16, 2, 8, torch.bfloat16) == pool.numel() * pool.element_size() // 10
    k_cache = pool[1, 0]  # a layer's K cache is a contiguous [P, ps, Hkv, D] view
    assert k_cache.is_contiguous() and k_cache.shape == (10, 16, 2, 8)


def test_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="page_size must be positive, got 0"):
        allocate_kv_pool(1, 4, 0, 1, 8, torch.float32, "cpu")
