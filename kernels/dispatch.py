"""The kernel backend registry: which backend ops on a device run with, chosen once.

Resolution: the ``backend=`` argument, then env ``PREFIXGATE_KERNEL_BACKEND``, then ``auto``
(the first registered backend that prefers the device and is installed):

* ``triton`` — the Triton kernels (kernels/triton/): auto on CUDA; on CPU tensors only under
  ``TRITON_INTERPRET=1`` (tests);
* ``torch``  — plain torch (kernels/torch_cpu/), the production CPU path: auto anywhere else.

The runner resolves once at start-up and binds the backend object to its KV pool
(:func:`create_backend`; the object's interface is kernels/backend.py). The one-off ops below
(``write_kv``, ``paged_attention``, ``copy_pages``) resolve per call: they serve tests and
benchmarks, never the model's hot path. ``triton`` is an optional dependency (extras
``gpu``/``dev``): a backend's module is imported when it is first created or called, so
``import kernels`` works without it. Each (device type, backend) choice is logged once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prefixgate.kernels.attention_plan import AttentionPlan
from prefixgate.kernels.backend import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_ENV = "PREFIXGATE_KERNEL_BACKEND"

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


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A registered backend.

    Args:
        name: what ``--kernel-backend`` / the env / ``backend=`` call it.
        target: ``"module:Class"`` of its backend object, imported on first use.
        auto_on: device types ``auto`` picks it for (None: any device).
        installed: whether its package imports here.
        install: how to install it (for the errors).
        runs_on: whether it can run on a device type (given explicitly).
        requirement: what it needs when it cannot (for the errors).
        native_cpu: it hands fp32 CPU rows to the native kernels (kernels/cpu/).
        moe: ``"module:function"`` of its routed-experts op (an MoE MLP's chosen experts in
            one call; layout in kernels/torch_cpu/moe.py), imported on first use.
        gated_delta: ``"module:function"``: ``bind(native) -> GatedDeltaOps``, a hybrid
            model's linear-attention ops (kernels/torch_cpu/gated_delta.py has the layout).
    """

    name: str
    target: str
    auto_on: frozenset[str] | None = None
    installed: Callable[[], bool] = lambda: True
    install: str = ""
    runs_on: Callable[[str], bool] = lambda device_type: True
    requirement: str = ""
    native_cpu: bool = False
    moe: str = ""
    gated_delta: str = ""

    def load(self) -> Any:
        return _import(self.target)


def _import(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add a backend; registration order is ``auto``'s order of preference."""
    _REGISTRY[spec.name] = spec


def backend_spec(name: str) -> BackendSpec:
    return _REGISTRY[name]


def _requested(backend: str | None) -> tuple[str, str]:
    """The asked-for name (lowercased) and where it came from."""
    source = "argument"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        source = f"env {BACKEND_ENV}"
    if backend is None:
        backend, source = "auto", "auto"
    backend = backend.strip().lower()
    if backend != "auto" and backend not in _REGISTRY:
        raise ValueError(f"unknown kernel backend {backend!r} (from {source}); use one of "
                         f"{('auto', *_REGISTRY)}")
    return backend, source


def _auto(device: torch.device) -> str:
    for spec in _REGISTRY.values():
        if spec.auto_on is not None and device.type not in spec.auto_on:
            continue
        if spec.installed():
            _log_once(device, spec.name, "auto")
            return spec.name
        _log_once(device, "torch", f"auto, {spec.name} not installed: {spec.install}",
                  level=logging.WARNING)
    return "torch"


def resolve_backend(device: torch.device | str, backend: str | None = None) -> str:
    """The name of the backend ops on ``device`` run with.

    Raises:
        ValueError: unknown backend name, or one asked for on a device it cannot run on
            (``triton`` on CPU without the interpreter).
        RuntimeError: a backend asked for explicitly but not installed.
    """
    device = torch.device(device)
    name, source = _requested(backend)
    if name == "auto":
        return _auto(device)
    spec = _REGISTRY[name]
    if not spec.installed():
        raise RuntimeError(f"kernel backend {name!r} requested ({source}) but {name} is not "
                           f"installed; {spec.install} or use the torch backend")
    if not spec.runs_on(device.type):
        raise ValueError(f"kernel backend {name!r} requested ({source}) for {device} tensors; "
                         f"it needs {spec.requirement}")
    _log_once(device, name, source)
    return name


def _log_once(device: torch.device, backend: str, source: str, level: int = logging.INFO) -> None:
    key = (device.type, backend)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, "kernels on %s use the %s backend (%s)", device.type, backend, source)


def backend_name(device: torch.device | str, backend: str | None = None) -> str:
    """The name of the backend (``"triton"``, ``"torch"``) ops on ``device`` run with."""
    return resolve_backend(device, backend)


def create_backend(name: str, kv_pool: torch.Tensor, **options: Any) -> AttentionBackend:
    """The backend object ``name`` (a resolved name) bound to ``kv_pool``; ``options`` are the
    backend's own (``native``, ``share_prefixes``: see kernels/torch_cpu/backend.py)."""
    return _REGISTRY[name].load()(kv_pool, **options)


def moe_experts_op(name: str) -> Callable[..., torch.Tensor]:
    """The routed-experts op of backend ``name`` (a resolved name), bound once by the model:
    ``op(x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k], experts [T, k])``."""
    return _import(_REGISTRY[name].moe)


def gated_delta_ops(name: str, native: bool = False) -> Any:
    """The linear-attention ops (``GatedDeltaOps``: conv, rule) of backend ``name``, bound once
    by a hybrid model; ``native``: the native CPU kernels where they build."""
    return _import(_REGISTRY[name].gated_delta)(native)


def _ops(device: torch.device, backend: str | None) -> Any:
    return _REGISTRY[resolve_backend(device, backend)].load()


register_backend(BackendSpec(
    "triton", "prefixgate.kernels.triton.backend:TritonBackend", auto_on=frozenset({"cuda"}),
    installed=triton_available, install="pip install 'prefixgate[gpu]'",
    runs_on=lambda device_type: device_type == "cuda" or _interpreting(),
    requirement="CUDA, or TRITON_INTERPRET=1 to run in Triton's CPU interpreter",
    moe="prefixgate.kernels.triton.moe:moe_experts_triton",
    gated_delta="prefixgate.kernels.triton.gated_delta:bind_ops",
))
register_backend(BackendSpec(
    "torch", "prefixgate.kernels.torch_cpu.backend:TorchBackend", native_cpu=True,
    moe="prefixgate.kernels.torch_cpu.moe:moe_experts_torch",
    gated_delta="prefixgate.kernels.torch_cpu.gated_delta:bind_ops",
))


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
    caches; kernels/cpu/ops.py). ``check=False``: the torch backend skips the shape/dtype/device
    validation (slot values are still bounds-checked).
    """
    _ops(key.device, backend).write_kv(key, value, k_cache, v_cache, slot_mapping,
                                       native=native, check=check)


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
        plan: the torch backend's per-step plan (``plan_attention``); None = planned per
            call. Ignored by the Triton backend.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: env, then auto).
        check: False = the torch backend skips the shape/dtype/device validation.
    """
    return _ops(query.device, backend).paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        max_query_len=max_query_len, plan=plan, check=check,
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
    _ops(kv_pool.device, backend).copy_pool_pages(kv_pool, src, dst)
