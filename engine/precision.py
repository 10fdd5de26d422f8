"""Compute precision modes (``--dtype``): which exist, and whether this machine can run them.

``auto`` is fp32 on CPU (exact: greedy identical to transformers) and bf16 on GPU. ``bf16`` on
CPU is the mixed mode of docs/precision.md: bf16 matrices, fp32 activations, products summed
in fp32 (AMX tiles or AVX512-BF16), the bf16 KV cache by default; it is refused where the CPU
has neither instruction set, since its GEMMs would then run emulated, slower than fp32.
``q8`` (CPU only) keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks and quantizes each matrix input row to
int8 per 32 values, as llama.cpp does (AVX512-VNNI integer dot products); everything else is
the fp32 mode's. It is refused without AVX512-VNNI / AVX512-BW or the native kernels.
"""

from __future__ import annotations

import torch

from prefixgate.engine.kv_budget import resolve_device, resolve_dtype
from prefixgate.kernels.cpu.library import bf16_instructions, int8_instructions, native_status
from prefixgate.kernels.cpu.ops import q8_native_available

Q8 = "q8"  # the int8-activation mode's name (config.DTYPES)


def is_q8(dtype: str | torch.dtype | None) -> bool:
    """Whether ``dtype`` names the int8-activation mode."""
    return isinstance(dtype, str) and dtype.lower() == Q8


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


def cpu_int8_isa(device: torch.device) -> str:
    """The instructions the q8 mode's products run on (``"avx512_vnni"``).

    Raises:
        ValueError: not a CPU, the CPU lacks AVX512-VNNI / AVX512-BW, or the native library
            (which holds the only implementation) is not available here.
    """
    if device.type != "cpu":
        raise ValueError(f"dtype q8 is a CPU mode (int8 activations on AVX512-VNNI), not for "
                         f"{device}; use --dtype auto (bf16) there")
    isa = int8_instructions()
    if isa is None:
        raise ValueError(
            "dtype q8 needs AVX512-VNNI and AVX512-BW (cpu flags avx512_vnni / avx512bw), which "
            "this CPU lacks: its int8 products would be emulated, slower than fp32; use --dtype "
            "fp32 (the default on CPU)"
        )
    if not q8_native_available():
        raise ValueError(f"dtype q8 needs the native CPU kernels, which are {native_status()}; "
                         "use --dtype fp32 (the default on CPU)")
    return isa


def check_precision(device: str | None, dtype: str | None) -> None:
    """Refuse, before anything loads, a ``dtype`` this ``device`` cannot compute in.

    Raises:
        ValueError: an unknown dtype, bf16 on a CPU without bf16 instructions, or q8 where it
            cannot run (:func:`cpu_int8_isa`).
    """
    resolved = resolve_device(device)
    if is_q8(dtype):
        cpu_int8_isa(resolved)
    elif resolved.type == "cpu" and resolve_dtype(dtype, resolved) == torch.bfloat16:
        cpu_bf16_isa()


__all__ = ["Q8", "check_precision", "cpu_bf16_isa", "cpu_int8_isa", "is_q8"]
