"""A weight matrix kept in ggml's block quantization (Q4_0, Q4_1, Q8_0), and its exact fp32 values.

Each row of ``[rows, cols]`` is ``cols / 32`` blocks of 32 weights, stored as in the GGUF file:
  * Q4_0 (18 B): fp16 d, 16 bytes of nibbles; weight = d * (q - 8)
  * Q4_1 (20 B): fp16 d, fp16 m, 16 bytes of nibbles; weight = d * q + m
  * Q8_0 (34 B): fp16 d, 32 int8; weight = d * q
where byte j of the nibbles holds weight j (low) and weight j + 16 (high). :meth:`dequantize`
gives exactly gguf's values (``gguf.quants.dequantize``), the oracle of the native kernel
(kernels/cpu/csrc/linear_quant.c), which computes on these blocks directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per ggml block
# ggml's type ids, which the native kernel takes too
QUANT_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A ``[rows, cols]`` matrix as ggml blocks: ``data`` is uint8 ``[rows, cols / 32 * block
    bytes]`` on CPU, rows in order (a row's blocks are independent of other rows, so rows can be
    concatenated, permuted and gathered as bytes)."""

    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"quantization {self.qtype!r} not supported; {sorted(BLOCK_BYTES)}")
        rows, cols = self.shape
        expected = (rows, cols // BLOCK * BLOCK_BYTES[self.qtype])
        if cols % BLOCK or self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"{self.qtype} {self.shape}: data must be uint8 {expected}, got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[rows, cols]`` values, bit for bit gguf's."""
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // BLOCK, BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, groups, 1]
        if self.qtype == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(rows, cols)
        nibbles = blocks[..., -16:]
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)  # weights 0..15, then 16..31
        if self.qtype == "Q4_0":
            return (d * (q.to(torch.int8) - 8).float()).reshape(rows, cols)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q.float() + m).reshape(rows, cols)


    def integer_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q, d, m)``: the integer weights ``[rows, cols / 32, 32]`` (int32; Q4_0's
        ``q - 8``), the fp32 scales ``[rows, cols / 32]`` and Q4_1's fp32 mins (else None), so
        that a weight is ``d * q (+ m)``."""
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // BLOCK, BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
        if self.qtype == "Q8_0":
            return blocks[..., 2:].contiguous().view(torch.int8).int(), d, None
        nibbles = blocks[..., -16:]
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).int()
        if self.qtype == "Q4_0":
            return q - 8, d, None
        return q, d, blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 as llama.cpp's q8 activations, the way kernels/cpu/csrc/linear_q8.c
    computes them, bit for bit: per row and 32 k, ``q = round_half_even(x * (127 / amax))``
    (int32 ``[M, K / 32, 32]``, 0 where amax is 0) and ``d = amax * fp32(1 / 127)`` (fp32
    ``[M, K / 32]``)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = (blocks * inv[..., None]).round().int()
    one_127 = torch.tensor(1.0) / torch.tensor(127.0)
    return q, amax * one_127


def linear_q8_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """``x @ W.T`` as the int8-activation kernel defines it: ``x`` quantized by
    :func:`quantize_rows_q8`, per block the exact integer sum times ``d_w * d_x`` (plus Q4_1's
    ``m_w * d_x * sum q``), summed over blocks in fp64: the oracle of linear_q8.c up to its
    fp32 rounding."""
    qx, dx = quantize_rows_q8(x)
    qw, dw, mw = weight.integer_parts()
    dots = torch.einsum("mgk,ngk->mng", qx.double(), qw.double())  # exact integers
    out = dots * dx.double()[:, None, :] * dw.double()[None]
    if mw is not None:
        sums = (dx * qx.sum(-1).float()).double()  # fp32 d * s, as the kernel rounds it
        out = out + mw.double()[None] * sums[:, None, :]
    return out.sum(-1)


def cat_rows(tensors: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The matrices stacked along rows (fused q|k|v, gate|up); one quantization, same width."""
    first = tensors[0]
    if any(t.qtype != first.qtype or t.shape[1] != first.shape[1] for t in tensors):
        raise ValueError("cat_rows: every part needs the same quantization and width")
    rows = sum(t.shape[0] for t in tensors)
    data = torch.cat([t.data for t in tensors])
    return QuantizedTensor(first.qtype, data, (rows, first.shape[1]))


__all__ = [
    "BLOCK", "BLOCK_BYTES", "QUANT_TYPE_IDS", "QuantizedTensor", "cat_rows", "linear_q8_reference",
    "quantize_rows_q8",
]
