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


def cat_rows(tensors: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The matrices stacked along rows (fused q|k|v, gate|up); one quantization, same width."""
    first = tensors[0]
    if any(t.qtype != first.qtype or t.shape[1] != first.shape[1] for t in tensors):
        raise ValueError("cat_rows: every part needs the same quantization and width")
    rows = sum(t.shape[0] for t in tensors)
    data = torch.cat([t.data for t in tensors])
    return QuantizedTensor(first.qtype, data, (rows, first.shape[1]))


__all__ = ["BLOCK", "BLOCK_BYTES", "QUANT_TYPE_IDS", "QuantizedTensor", "cat_rows"]
