"""Compute precision modes (``--dtype``): which exist, and whether this machine can run them.

``auto`` is fp32 on CPU (exact: greedy identical to transformers) and bf16 on GPU. ``bf16`` on
CPU is the mixed mode of docs/precision.md: bf16 matrices, fp32 activations, products summed
in fp32 (AMX tiles or AVX512-BF16), the bf16 KV cache by default; it is refused where the CPU
has neither instruction set, since its GEMMs would then run emulated, slower than fp32.
"""

from __future__ import annotations

import torch

from prefixgate.gateway.engine.kv_budget import resolve_device, resolve_dtype
from prefixgate.kernels.cpu.library import bf16_instructions


def cpu_bf16_isa() -> str:
    """The bf16 instructions the CPU bf16 mode runs on (``"amx_bf16"`` / ``"avx512_bf16"``).

    Raises:
        ValueError: the CPU has neither; the message says what to use instead.
    """
    isa = bf16_instructions()
    if isa is None:
        raise ValueError(
            "dtype bf16 on CPU needs AVX512-BF16 or AMX-BF16 instructions (cpu flags "
            "avx512_bf16 / amx_bf16), which this CPU lacks: its bf16 GEMMs would be emulated, "
            "slower than fp32; use --dtype fp32 (the default on CPU)"
        )
    return isa


def check_precision(device: str | None, dtype: str | None) -> None:
    """Refuse, before anything loads, a ``dtype`` this ``device`` cannot compute in.

    Raises:
        ValueError: an unknown dtype, or bf16 on a CPU without bf16 instructions.
    """
    resolved = resolve_device(device)
    if resolved.type == "cpu" and resolve_dtype(dtype, resolved) == torch.bfloat16:
        cpu_bf16_isa()


__all__ = ["check_precision", "cpu_bf16_isa"]
