"""The Triton backend as an object (kernels/backend.py). Imported only when it is chosen."""

from __future__ import annotations

import torch

from prefixgate.kernels.backend import AttentionInputs
from prefixgate.kernels.checks import check_kv_caches
from prefixgate.kernels.triton.attention import paged_attention_triton
from prefixgate.kernels.triton.copy_pages import copy_pages_triton
from prefixgate.kernels.triton.write_kv import write_kv_triton


class TritonStep:
    """One step's attention on the Triton backend (``StepAttention``).

    The launchers read their shapes through their checks on every call (they need them to
    size the grid); none of them syncs the device. A sliding layer's window is a mask in the
    same kernels (they start at the first page the window reaches).
    """

    __slots__ = ("_inputs",)

    def __init__(self, inputs: AttentionInputs) -> None:
        self._inputs = inputs

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        inputs = self._inputs
        write_kv_triton(key, value, k_cache, v_cache, inputs.slot_mapping)
        return paged_attention_triton(
            query, k_cache, v_cache, inputs.block_tables_tensor, inputs.seq_lens_tensor,
            inputs.query_start_loc_tensor, scale,
            max_query_len=inputs.max_query_len,  # host int: no device sync to learn it
            window=window,
            sinks=sinks,
        )


class TritonBackend:
    """Triton kernels over the paged pool (CUDA; the CPU interpreter in tests).

    Args:
        kv_pool: ``[L, 2, num_pages, page_size, Hkv, D]``; its layout is checked here, once.
        native / share_prefixes: torch-backend options, ignored here.
    """

    name = "triton"

    def __init__(self, kv_pool: torch.Tensor, *, native: bool = False,
                 share_prefixes: bool = True) -> None:
        check_kv_caches(kv_pool[0, 0], kv_pool[0, 1])
        self.kv_pool = kv_pool

    def prepare_metadata(self, inputs: AttentionInputs) -> TritonStep:
        return TritonStep(inputs)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_pages_triton(self.kv_pool, src, dst)

    # one-off ops (kernels.write_kv & co), the same signature on every backend

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, native: bool = False,
                 check: bool = True) -> None:
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    @staticmethod
    def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        max_query_len: int | None = None, plan: object = None,
                        check: bool = True) -> torch.Tensor:
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale, max_query_len=max_query_len)

    copy_pool_pages = staticmethod(copy_pages_triton)
