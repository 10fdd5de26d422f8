"""The torch backend as an object (kernels/backend.py): planned once per step, bound at start-up."""

from __future__ import annotations

import torch

from prefixgate.kernels.attention_plan import (
    AttentionPlan,
    PaddedDecode,
    plan_attention,
    unshared_decode,
)
from prefixgate.kernels.backend import AttentionInputs
from prefixgate.kernels.checks import check_attention_inputs, check_kv_caches, check_write_inputs
from prefixgate.kernels.cpu.ops import NativeKVWriter, bind_kv_writer, kv_write_accepts
from prefixgate.kernels.sliding_window import paged_attention_windowed
from prefixgate.kernels.torch_cpu.attention import (
    copy_pages_torch,
    paged_attention_torch,
    write_kv_torch,
)
from prefixgate.kernels.torch_cpu.windowed import paged_attention_windowed_native


class TorchStep:
    """One step's attention on the torch backend (``StepAttention``)."""

    __slots__ = ("_checked", "_inputs", "_kv_row_elems", "_sliding_decode", "_writer", "plan")

    def __init__(self, inputs: AttentionInputs, plan: AttentionPlan,
                 writer: NativeKVWriter | None, kv_row_elems: int) -> None:
        self._inputs, self.plan, self._writer = inputs, plan, writer
        self._kv_row_elems = kv_row_elems
        self._checked = False
        self._sliding_decode: list[PaddedDecode] | None = None  # planned by the first sliding layer

    def _check(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The step's first layer: validate the layout every later layer shares."""
        inputs = self._inputs
        check_write_inputs(key, value, k_cache, v_cache, inputs.slot_mapping)
        check_attention_inputs(query, k_cache, v_cache, inputs.block_tables_tensor,
                               inputs.seq_lens_tensor, inputs.query_start_loc_tensor)
        if self._writer is not None and not kv_write_accepts(key, value, k_cache, v_cache,
                                                             inputs.slot_mapping):
            self._writer = None
        self._checked = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not self._checked:
            self._check(query, key, value, k_cache, v_cache)
        inputs = self._inputs
        if self._writer is not None:
            self._writer(key, value, k_cache, v_cache, inputs.slot_mapping)
        else:
            write_kv_torch(key, value, k_cache, v_cache, inputs.slot_mapping, check=False)
        addressing = (inputs.block_tables_tensor, inputs.seq_lens_tensor,
                      inputs.query_start_loc_tensor)
        # a sliding layer, or a layer with attention sinks (gpt-oss: sliding or full), reads
        # each row's own pages: the sinks join the softmax inside the native kernels
        if (window is not None or sinks is not None) and self.plan.use_native:
            return paged_attention_windowed_native(
                query, k_cache, v_cache, inputs.block_tables_tensor, self.plan,
                self._unshared_decode(k_cache.shape[1]), scale, window, sinks,
            )
        if window is not None or sinks is not None:
            return paged_attention_windowed(query, k_cache, v_cache, *addressing, scale, window,
                                            check=False, sinks=sinks)
        return paged_attention_torch(query, k_cache, v_cache, *addressing, scale, self.plan,
                                     check=False)

    def _unshared_decode(self, page_size: int) -> list[PaddedDecode]:
        """The step's decode rows for its sliding layers, planned once for all of them."""
        if self._sliding_decode is None:
            self._sliding_decode = unshared_decode(
                self.plan, self._inputs.block_tables, page_size=page_size,
                kv_row_elems=self._kv_row_elems, device=self._inputs.block_tables_tensor.device,
            )
        return self._sliding_decode


class TorchBackend:
    """Plain torch over the paged pool; fp32 rows go to the native CPU kernels when ``native``.

    Args:
        kv_pool: ``[L, 2, num_pages, page_size, Hkv, D]`` (kernels/layout.py); its layout is
            checked here, once.
        native: decode/prefill attention and the K/V write run natively where the library
            built (the runner decides: CPU, fp32 compute).
        share_prefixes: decode rows that share a run of prefix pages attend to it once
            (cascade attention, kernels/attention_plan.py).
    """

    name = "torch"

    def __init__(self, kv_pool: torch.Tensor, *, native: bool = False,
                 share_prefixes: bool = True) -> None:
        check_kv_caches(kv_pool[0, 0], kv_pool[0, 1])
        self.kv_pool = kv_pool
        self.native = native
        self.share_prefixes = share_prefixes
        self.page_size = kv_pool.shape[3]
        self.kv_row_elems = kv_pool.shape[4] * kv_pool.shape[5]
        # the native scatter for this pool's dtype, bound now, not looked up per layer
        self.kv_writer = bind_kv_writer(kv_pool) if native else None

    def prepare_metadata(self, inputs: AttentionInputs) -> TorchStep:
        # every layer reads the same addressing: sort it out once per step, on the host
        plan = plan_attention(
            inputs.block_tables, inputs.seq_lens, inputs.query_start_loc,
            page_size=self.page_size, kv_row_elems=self.kv_row_elems,
            device=self.kv_pool.device, share_prefixes=self.share_prefixes,
            use_native=self.native,
        )
        return TorchStep(inputs, plan, self.kv_writer, self.kv_row_elems)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_pages_torch(self.kv_pool, src, dst)

    # one-off ops for callers without a pool-bound backend (kernels.write_kv & co: tests,
    # benchmarks); the same signature on every backend

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, native: bool = False,
                 check: bool = True) -> None:
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping, native, check)

    @staticmethod
    def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        max_query_len: int | None = None, plan: AttentionPlan | None = None,
                        check: bool = True) -> torch.Tensor:
        return paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, plan, check)

    copy_pool_pages = staticmethod(copy_pages_torch)
