"""MXFP4 matrices (OCP microscaling FP4, gpt-oss's expert weights) kept in their blocks, and the
torch reference: exact dequantization, a quantizer from the spec, and the linear layer.

One block is 32 consecutive weights of a row: an e8m0 scale byte ``e`` (the power of two
``2^(e - 127)``; ``e = 0`` is ``2^-127`` and ``e = 255`` inf, as ggml reads them) and 32 e2m1
nibbles (sign, 2 exponent bits, 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}). A weight is
``e2m1 * 2^(e - 127)``, exact in fp32.

The two checkpoint layouts differ only in the order of the nibbles:
  * HF (``*_blocks`` ``[..., rows, K / 32, 16]`` + ``*_scales`` ``[..., rows, K / 32]``): byte j
    holds weights 2j (low nibble) and 2j + 1 (high);
  * GGUF (ggml type MXFP4, 17-byte blocks: the scale, then 16 bytes): byte j holds weights j
    (low) and j + 16 (high).
:class:`Mxfp4Tensor` keeps ggml's order (the native kernel, kernels/cpu/csrc/linear_mxfp4.c,
pairs the low nibbles with ``x[0:16]`` and the high ones with ``x[16:32]``) in two arrays; HF
blocks are reordered once at load, byte for byte, never expanded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

MXFP4_BLOCK = 32  # weights per block
MXFP4_BLOCK_BYTES = 16  # nibble bytes per block (the scale is apart)
GGUF_BLOCK_BYTES = 17  # ggml's block_mxfp4: e8m0 scale + 16 nibble bytes
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 exponents as fp32 powers of two, as ggml's ``ggml_e8m0_to_fp32``."""
    bits = scales.to(torch.int32) << 23
    bits = torch.where(scales == 0, torch.tensor(0x00400000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


@dataclass(frozen=True, slots=True)
class Mxfp4Tensor:
    """A ``[rows, cols]`` matrix in MXFP4 blocks: ``nibbles`` uint8 ``[rows, cols / 32, 16]``
    (ggml's order, see the module docstring) and ``scales`` uint8 ``[rows, cols / 32]``. Rows
    are independent: they can be sliced, gathered and concatenated as bytes."""

    nibbles: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        groups = cols // MXFP4_BLOCK
        if (cols % MXFP4_BLOCK or self.nibbles.dtype != torch.uint8
                or self.scales.dtype != torch.uint8
                or tuple(self.nibbles.shape) != (rows, groups, MXFP4_BLOCK_BYTES)
                or tuple(self.scales.shape) != (rows, groups)):
            raise ValueError(
                f"MXFP4 {self.shape}: needs cols a multiple of 32, uint8 nibbles "
                f"{(rows, groups, MXFP4_BLOCK_BYTES)} and scales {(rows, groups)}; got "
                f"{self.nibbles.dtype} {tuple(self.nibbles.shape)}, {self.scales.dtype} "
                f"{tuple(self.scales.shape)}")

    @property
    def nbytes(self) -> int:
        return self.nibbles.numel() + self.scales.numel()

    def rows(self, index: slice | torch.Tensor) -> Mxfp4Tensor:
        """The rows ``index`` picks (a slice or an index tensor), as their own matrix."""
        nibbles, scales = self.nibbles[index].contiguous(), self.scales[index].contiguous()
        return Mxfp4Tensor(nibbles, scales, (nibbles.shape[0], self.shape[1]))

    def to(self, device: torch.device | str) -> Mxfp4Tensor:
        return Mxfp4Tensor(self.nibbles.to(device), self.scales.to(device), self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[rows, cols]`` values, exact (the expanded reference)."""
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.nibbles.device)
        codes = torch.cat([self.nibbles & 15, self.nibbles >> 4], dim=-1).long()  # [R, G, 32]
        values = table[codes] * e8m0_to_float(self.scales)[..., None]
        return values.reshape(self.shape).to(dtype)

    @classmethod
    def from_hf(cls, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Tensor:
        """HF's ``*_blocks`` ``[rows, K / 32, 16]`` and ``*_scales`` ``[rows, K / 32]`` (one
        expert's), the nibbles reordered from HF's pairs (2j, 2j + 1) to ggml's (j, j + 16)."""
        rows, groups, _ = blocks.shape
        codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(rows, groups, 32)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        return cls(nibbles.contiguous(), scales.to(torch.uint8).contiguous(),
                   (rows, groups * MXFP4_BLOCK))

    @classmethod
    def from_gguf(cls, data: torch.Tensor, shape: tuple[int, int]) -> Mxfp4Tensor:
        """A GGUF MXFP4 tensor's bytes ``[rows, cols / 32 * 17]`` (scale, 16 nibble bytes)."""
        rows, cols = shape
        blocks = data.reshape(rows, cols // MXFP4_BLOCK, GGUF_BLOCK_BYTES)
        return cls(blocks[..., 1:].contiguous(), blocks[..., 0].contiguous(), shape)

    def to_gguf(self) -> torch.Tensor:
        """The ggml bytes ``[rows, cols / 32 * 17]`` (what :meth:`from_gguf` reads)."""
        blocks = torch.cat([self.scales[..., None], self.nibbles], dim=-1)
        return blocks.reshape(self.shape[0], -1)

    def to_hf(self) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's ``(blocks, scales)`` for this matrix (what :meth:`from_hf` reads)."""
        codes = torch.cat([self.nibbles & 15, self.nibbles >> 4], dim=-1)  # weights 0..31
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return blocks.contiguous(), self.scales.clone()


@dataclass(frozen=True, slots=True)
class Mxfp4Experts:
    """A layer's experts in MXFP4, one ``[rows, cols]`` matrix per expert, read as the stacked
    ``[E, rows, cols]`` weight they are (``shape``; ``dequantize()``; iterating gives the
    experts)."""

    parts: tuple[Mxfp4Tensor, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def __iter__(self) -> Iterator[Mxfp4Tensor]:
        return iter(self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([part.dequantize(dtype) for part in self.parts])

    @classmethod
    def from_hf(cls, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Experts:
        """HF's stacked ``*_blocks`` ``[E, rows, K / 32, 16]`` and ``*_scales``."""
        return cls(tuple(Mxfp4Tensor.from_hf(b, s) for b, s in zip(blocks, scales, strict=True)))

    @classmethod
    def from_rows(cls, stacked: Mxfp4Tensor, num_experts: int) -> Mxfp4Experts:
        """An ``[E * rows, cols]`` matrix (a GGUF's stacked experts) split into its experts."""
        rows = stacked.shape[0] // num_experts
        return cls(tuple(stacked.rows(slice(e * rows, (e + 1) * rows))
                         for e in range(num_experts)))


def quantize_mxfp4(weight: torch.Tensor) -> Mxfp4Tensor:
    """``weight [rows, cols]`` as MXFP4, from the OCP MX spec as gguf-py's quantizer does it:
    per block, ``e = floor(log2(amax)) - 2 + 127`` (e2m1's largest exponent is 2), then each
    weight to the nearest of the 16 ``e2m1 * 2^(e - 127)`` (the first on a tie; 0 for an
    all-zero block)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127,
                           torch.zeros(())).clamp(0, 254).to(torch.uint8)
    table = torch.tensor(E2M1_VALUES) * e8m0_to_float(exponent)[..., None]  # [R, G, 16]
    codes = (blocks[..., None] - table[..., None, :]).abs().argmin(-1).to(torch.uint8)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return Mxfp4Tensor(nibbles.contiguous(), exponent.contiguous(), (rows, cols))


def linear_mxfp4_reference(x: torch.Tensor, weight: Mxfp4Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` with W dequantized first: the oracle of the native kernel,
    and its fallback (expanded per call, for the matrix at hand only: nothing kept)."""
    out = x.float() @ weight.dequantize().T
    return out if bias is None else out + bias.float()


def cat_rows_mxfp4(parts: Sequence[Mxfp4Tensor]) -> Mxfp4Tensor:
    """The matrices stacked along rows (gate | up), one width."""
    if any(p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError("cat_rows_mxfp4: every part needs the same width")
    return Mxfp4Tensor(torch.cat([p.nibbles for p in parts]), torch.cat([p.scales for p in parts]),
                       (sum(p.shape[0] for p in parts), parts[0].shape[1]))


__all__ = ["E2M1_VALUES", "MXFP4_BLOCK", "Mxfp4Experts", "Mxfp4Tensor", "cat_rows_mxfp4", "e8m0_to_float",
           "linear_mxfp4_reference", "quantize_mxfp4"]
