"""Input validation shared by the torch backend and the Triton launchers.

Every check looks only at shapes, dtypes, devices and strides, never at values, so it never
forces a GPU sync. Bad input raises ``ValueError`` naming the argument and what was expected.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionShapes(NamedTuple):
    """Sizes of one ``paged_attention`` call, read from its arguments."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    num_seqs: int
    max_pages_per_seq: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` when ``condition`` is false (survives ``python -O``)."""
    if not condition:
        raise ValueError(message)


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    require(tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}")


def _check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    require(
        tensor.dim() == ndim,
        f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}",
    )


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        require(
            device == first,
            f"all tensors must be on one device; {name} is on {device}, "
            f"{next(iter(devices))} on {first}",
        )


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches: ``[num_pages, page_size, Hkv, D]``, same shape/dtype/strides, dense rows."""
    _check_ndim("k_cache", k_cache, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    require(
        v_cache.shape == k_cache.shape,
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}",
    )
    require(
        v_cache.dtype == k_cache.dtype,
        f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}",
    )
    require(
        v_cache.stride() == k_cache.stride(),
        f"v_cache strides {v_cache.stride()} != k_cache strides {k_cache.stride()}",
    )
    require(
        k_cache.stride(-1) == 1, f"k_cache last dim must be contiguous, strides {k_cache.stride()}"
    )
    require(k_cache.is_floating_point(), f"k_cache must be floating point, got {k_cache.dtype}")


def check_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> AttentionShapes:
    """Validate ``paged_attention`` arguments (see kernels/layout.py) and return their sizes."""
    _check_ndim("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    check_kv_caches(k_cache, v_cache)
    _check_ndim("block_tables", block_tables, 2, "[num_seqs, max_pages]")
    _check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    _check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    _check_dtype("block_tables", block_tables, torch.int32)
    _check_dtype("seq_lens", seq_lens, torch.int32)
    _check_dtype("query_start_loc", query_start_loc, torch.int32)
    require(query.is_floating_point(), f"query must be floating point, got {query.dtype}")
    _check_same_device(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    num_tokens, num_q_heads, head_dim = query.shape
    num_pages, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    require(
        head_dim == cache_head_dim, f"query head_dim {head_dim} != cache head_dim {cache_head_dim}"
    )
    require(
        num_q_heads % num_kv_heads == 0,
        f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}",
    )
    require(
        block_tables.shape[0] == num_seqs,
        f"block_tables has {block_tables.shape[0]} rows but seq_lens has {num_seqs} sequences",
    )
    require(
        query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
        f"got {query_start_loc.shape[0]}",
    )
    return AttentionShapes(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        num_seqs=num_seqs,
        max_pages_per_seq=block_tables.shape[1],
    )


def check_write_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate ``write_kv`` arguments (see kernels/layout.py)."""
    check_kv_caches(k_cache, v_cache)
    _check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    require(
        value.shape == key.shape,
        f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}",
    )
    _check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _check_dtype("slot_mapping", slot_mapping, torch.int64)
    require(
        slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens",
    )
    require(
        key.shape[1:] == k_cache.shape[2:],
        f"key [T, Hkv, D] = {tuple(key.shape)} does not match cache [.., .., Hkv, D] = "
        f"{tuple(k_cache.shape)}",
    )
    _check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )


def check_copy_inputs(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Validate ``copy_pages`` arguments: a 6-D pool and equal-length int64 page id vectors."""
    _check_ndim("kv_pool", kv_pool, 6, "[num_layers, 2, num_pages, page_size, Hkv, D]")
    require(kv_pool.shape[1] == 2, f"kv_pool dim 1 must be 2 (K, V), got {kv_pool.shape[1]}")
    for name, ids in (("src", src), ("dst", dst)):
        _check_ndim(name, ids, 1, "[num_pairs]")
        _check_dtype(name, ids, torch.int64)
    require(src.shape == dst.shape, f"src has {src.shape[0]} page ids but dst has {dst.shape[0]}")
    _check_same_device(kv_pool=kv_pool, src=src, dst=dst)
