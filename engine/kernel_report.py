"""Which kernels a runner serves with, and why not the native CPU ones where they could run.

The native CPU library is built on first use (kernels/cpu/library.py); when the build fails or
times out every op falls back to its torch path, several times slower, and the server keeps
serving. This record is what the server shows for it: a warning at start-up and the
``kernel_backend`` / ``kernel_fallback_reason`` fields of ``/v1/models``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefixgate import kernels

NATIVE_OFF = "turned off (--native-kernels off)"


@dataclass(frozen=True, slots=True)
class KernelReport:
    """The kernels one engine runs on."""

    # "native-cpu" (torch backend + the native C kernels), "torch-cpu", "torch-cuda", "triton"
    backend: str
    # why the native CPU kernels are not used where they could be (None: they are, or the
    # device is a GPU)
    fallback_reason: str | None = None

    @property
    def degraded(self) -> bool:
        """The native CPU kernels were wanted but could not be used: worth a warning."""
        return self.fallback_reason is not None and self.fallback_reason != NATIVE_OFF


def kernel_report(runner: Any) -> KernelReport:
    """The report of a :class:`~engine.runner.ModelRunner`.

    NOTE: it reads what the runner decided at start-up and the library's status; it never
    starts a build."""
    device = runner.device.type
    if runner.native_cpu_kernels:
        return KernelReport("native-cpu")
    backend = f"{runner.kernel_backend}-{device}" if runner.kernel_backend == "torch" else (
        runner.kernel_backend)
    if device != "cpu" or not kernels.backend_spec(runner.kernel_backend).native_cpu:
        return KernelReport(backend)
    if runner.dtype not in (torch.float32, torch.bfloat16):
        return KernelReport(backend, f"no native CPU kernels for {runner.dtype}")
    if not getattr(runner, "native_kernels_requested", True):
        return KernelReport(backend, NATIVE_OFF)
    # wanted, on a CPU, in a precision they cover: the library did not load, and says why
    return KernelReport(backend, kernels.native_status())


def engine_kernel_report(engine: Any) -> KernelReport | None:
    """The report of an :class:`~engine.async_engine.AsyncEngine` (its core's runner);
    None for an engine without one (the tests' stand-ins)."""
    runner = getattr(getattr(engine, "core", None), "runner", None)
    return None if runner is None else kernel_report(runner)


__all__ = ["KernelReport", "engine_kernel_report", "kernel_report"]
