"""How big the KV pool is: pages from ``--num-pages`` or from a memory budget ``--kv-memory``.

Also the device/dtype defaults the runner uses: CUDA when available else CPU; fp32 on CPU
(fidelity, and CPUs have no fast bf16 attention path here), bf16 on GPU; the KV pool in the
model's dtype unless ``--kv-dtype`` says otherwise (a page's bytes, so the page count, follow
the pool's dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixgate import kernels
from prefixgate.engine.model_config import ModelConfig

GIB = 1 << 30
# without a budget: CPU takes this much for KV; a GPU takes this share of its free memory
DEFAULT_CPU_KV_MEMORY_GB = 1.0
DEFAULT_GPU_KV_MEMORY_FRACTION = 0.85

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class KVBudget(NamedTuple):
    num_pages: int
    page_size: int
    page_bytes: int  # one page, all layers, K and V

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` = CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` / ``"auto"`` = fp32 on CPU, bf16 on GPU; names: float32/fp32, bfloat16/bf16,
    float16/fp16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype.lower() == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: ``None`` / ``"auto"`` = the model's; else as :func:`resolve_dtype`."""
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype.lower() == "auto"):
        return model_dtype
    if isinstance(kv_dtype, torch.dtype):
        resolved = kv_dtype
    else:
        try:
            resolved = _DTYPES[kv_dtype.lower()]
        except KeyError:
            raise ValueError(
                f"unknown kv dtype {kv_dtype!r}; use auto, fp32, bf16 or fp16"
            ) from None
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kv dtype must be fp32, bf16 or fp16, got {resolved}")
    return resolved


def num_paged_layers(config: ModelConfig) -> int:
    """Layers that keep per-token K/V in the pages (a hybrid model's linear layers keep a
    state instead)."""
    linear = config.linear_attention
    return config.num_layers - (sum(linear.layers) if linear is not None else 0)


def state_slot_bytes(config: ModelConfig) -> int:
    """Bytes of one recurrent-state slot (every linear layer, fp32); 0 for attention-only
    models."""
    linear = config.linear_attention
    return 0 if linear is None else 4 * linear.state_numel * sum(linear.layers)


def default_state_slots(config: ModelConfig, max_num_seqs: int, kv_memory_gb: float | None) -> int:
    """A hybrid model's state slots when ``--state-slots`` is not given: as many as the KV
    budget's size holds again (1 GiB when unset), at least 8 and at most 16 per running
    sequence. Admission waits for a working slot when they run out, so a large model's few
    slots bound concurrency instead of over-committing memory."""
    slot = state_slot_bytes(config)
    if not slot:
        return 2
    budget = (kv_memory_gb or 1.0) * GIB
    return int(max(8, min(budget // slot, 16 * max_num_seqs)))


def kv_page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one physical page (every paged layer, K and V)."""
    return kernels.page_bytes(
        num_paged_layers(config), page_size, config.num_kv_heads, config.head_dim, dtype
    )


def plan_kv_budget(
    config: ModelConfig,
    *,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_pages: int | None = None,
    kv_memory_gb: float | None = None,
) -> KVBudget:
    """Pool size: ``num_pages`` if given, else as many pages as ``kv_memory_gb`` GiB hold.

    With neither: 1 GiB on CPU; 85% of the free memory on a GPU (call after loading weights).

    Raises:
        ValueError: non-positive inputs, or a budget smaller than one page.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    page_bytes = kv_page_bytes(config, page_size, dtype)
    if num_pages is not None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        return KVBudget(num_pages, page_size, page_bytes)
    if kv_memory_gb is not None:
        if kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {kv_memory_gb}")
        budget = kv_memory_gb * GIB
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = free * DEFAULT_GPU_KV_MEMORY_FRACTION
    else:
        budget = DEFAULT_CPU_KV_MEMORY_GB * GIB
    pages = int(budget // page_bytes)
    if pages < 1:
        raise ValueError(
            f"KV memory budget of {budget / GIB:.4f} GiB holds no page of {page_bytes} bytes "
            f"({config.num_layers} layers x {page_size} tokens); raise --kv-memory"
        )
    return KVBudget(pages, page_size, page_bytes)
