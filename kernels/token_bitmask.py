"""Apply a grammar's token bitmask to logits: forbidden tokens get -inf.

Layout (xgrammar's): ``bitmask [B, ceil(V / 32)] int32``, bit ``j`` of word ``w`` set = token
``32 * w + j`` allowed. ``logits [B, V]`` float, rows at any stride, changed in place.

On CPU in fp32 the native loop (kernels/cpu/csrc/token_bitmask.c) skips all-ones words with one
compare; elsewhere the torch version unpacks the bits (also the oracle in the tests).
"""

from __future__ import annotations

import torch

from prefixgate.kernels.cpu.library import library

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits [B, V] and bitmask [B, W] must share B; got {tuple(logits.shape)} and "
            f"{tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words, {logits.shape[1]} tokens need "
            f"{(logits.shape[1] + 31) // 32}"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device}, logits on {logits.device}")


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Torch version: unpack the words to one bool per token, then ``masked_fill_``."""
    _check(logits, bitmask)
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` in place by ``bitmask`` (native on CPU fp32, torch otherwise)."""
    _check(logits, bitmask)
    lib = library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.stride(1) != 1 or not bitmask.is_contiguous():
        apply_token_bitmask_ref(logits, bitmask)
        return
    lib.pg_apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
        logits.shape[0], logits.shape[1],
    )
