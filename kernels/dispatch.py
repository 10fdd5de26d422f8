"""Runtime choice between the Triton kernels and the torch reference.

Resolution order for each call: the ``backend=`` argument, then env
``PREFIXGATE_KERNEL_BACKEND``, then ``auto``:

* ``auto``   — Triton on CUDA tensors when ``triton`` imports, torch otherwise;
* ``triton`` — Triton; on CPU tensors only under ``TRITON_INTERPRET=1`` (tests);
* ``torch``  — the plain-torch reference (kernels/reference.py) anywhere.

``triton`` is an optional dependency (extras ``gpu``/``dev``): it is imported on first use
only, so ``import kernels`` works without it. Each (device type, backend) choice is logged
once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from prefixgate.kernels.attention_plan import AttentionPlan
from prefixgate.kernels.reference import copy_pages_ref, paged_attention_ref, write_kv_ref

logger = logging.getLogger(__name__)

BACKEND_ENV = "PREFIXGATE_KERNEL_BACKEND"
BACKENDS = ("auto", "triton", "torch")

_logged: set[tuple[str, str]] = set()


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works here (cached; logs why not, once)."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        logger.info("triton is not importable (%s); kernels use the torch backend", exc)
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(device: torch.device | str, backend: str | None = None) -> str:
    """The backend (``"triton"`` or ``"torch"``) ops on ``device`` run with.

    Raises:
        ValueError: unknown backend name, or ``triton`` asked for on CPU without the
            interpreter.
        RuntimeError: ``triton`` asked for explicitly but not installed.
    """
    device = torch.device(device)
    source = "argument"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        source = f"env {BACKEND_ENV}"
    if backend is None:
        backend = "auto"
        source = "auto"
    backend = backend.strip().lower()
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown kernel backend {backend!r} (from {source}); use one of {BACKENDS}"
        )
    if backend == "auto":
        chosen = "triton" if device.type == "cuda" and triton_available() else "torch"
        if device.type == "cuda" and chosen == "torch":
            _log_once(
                device,
                chosen,
                "auto, triton not installed: pip install 'prefixgate[gpu]'",
                level=logging.WARNING,
            )
        else:
            _log_once(device, chosen, source)
        return chosen
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                f"kernel backend 'triton' requested ({source}) but triton is not installed; "
                "pip install 'prefixgate[gpu]' or use the torch backend"
            )
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"kernel backend 'triton' requested ({source}) for {device} tensors; it needs "
                "CUDA, or TRITON_INTERPRET=1 to run in Triton's CPU interpreter"
            )
    _log_once(device, backend, source)
    return backend


def _log_once(device: torch.device, backend: str, source: str, level: int = logging.INFO) -> None:
    key = (device.type, backend)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, "kernels on %s use the %s backend (%s)", device.type, backend, source)


def backend_name(device: torch.device | str, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"``: which backend ops on ``device`` run with."""
    return resolve_backend(device, backend)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    *,
    backend: str | None = None,
    native: bool = False,
    check: bool = True,
) -> None:
    """Scatter each new token's K/V into its cache slot (``slot = page * page_size + offset``).

    ``native``: the torch backend may use the native CPU copy (fp32 K/V into fp32 or bf16
    caches; kernels/cpu/ops.py).
    ``check=False``: the torch backend skips the shape/dtype/device validation, for a caller
    that validated the same layout already this step (the model checks its first layer; every
    layer's caches are views of one pool). Slot values are still bounds-checked.
    """
    if resolve_backend(key.device, backend) == "triton":
        from prefixgate.kernels.triton.write_kv import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, native, check)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    seq_lens: torch.Tensor,  # [S] int32, context length after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
    check: bool = True,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new query rows over its paged context.

    Sequence s owns query rows ``query_start_loc[s]:query_start_loc[s+1]`` (its last n_s
    positions); their K/V must already be in the pages (``write_kv`` first).

    Args:
        max_query_len: optional host-side max n_s of the batch; ``1`` (pure decode) lets the
            Triton backend skip the prefill launch. Ignored by the torch backend.
        plan: the torch backend's per-step plan (``plan_attention``), built once for all
            layers; None = planned per call. Ignored by the Triton backend.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: env, then auto).
        check: False = the torch backend skips the shape/dtype/device validation (as for
            ``write_kv``); the Triton launcher always reads its shapes through it.
    """
    if resolve_backend(query.device, backend) == "triton":
        from prefixgate.kernels.triton.attention import paged_attention_triton

        return paged_attention_triton(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len=max_query_len,
        )
    return paged_attention_ref(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan, check
    )


def copy_pages(
    kv_pool: torch.Tensor,  # [L, 2, num_pages, page_size, Hkv, D]
    src: torch.Tensor,  # [N] int64
    dst: torch.Tensor,  # [N] int64
    *,
    backend: str | None = None,
) -> None:
    """Copy-on-write: ``kv_pool[:, :, dst[i]] = kv_pool[:, :, src[i]]`` for every layer, K and V.

    NOTE: ``dst`` ids must be distinct and disjoint from ``src`` (pairs copy in parallel).
    """
    if resolve_backend(kv_pool.device, backend) == "triton":
        from prefixgate.kernels.triton.copy_pages import copy_pages_triton

        copy_pages_triton(kv_pool, src, dst)
    else:
        copy_pages_ref(kv_pool, src, dst)
