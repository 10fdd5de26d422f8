"""The int8-activation linear (kernels/cpu/csrc/linear_q8.c) against its torch twin
(kernels/quant.py linear_q8_reference: the same activation quantization, exact integer block
sums), its row gather against gguf's values, and its independence of the batch."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.cpu.ops import (
    linear_q8_native,
    pack_q8_weight,
    q8_native_available,
    q8_rows_native,
)
from prefixgate.kernels.quant import linear_q8_reference, quantize_rows_q8
from tests.kernels.cpu.test_linear_quant import QTYPES, _quantized

needs_q8 = pytest.mark.skipif(
    not q8_native_available(), reason="int8-activation kernel not built here (no AVX512-VNNI)"
)


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows whose blocks differ in scale by orders of magnitude, one block all zero."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.exp(torch.empty(rows, cols // 32, 1).uniform_(-4, 3, generator=generator)).repeat(
        1, 1, 32).view(rows, cols)
    x[0, :32] = 0.0
    return x


def test_reference_quantization_is_llama_cpps():
    x = _activations(3, 96, seed=0)
    q, d = quantize_rows_q8(x)
    assert q.abs().max() <= 127 and (q[0, 0] == 0).all() and d[0, 0] == 0
    assert (q.abs().amax(-1)[d > 0] == 127).all()  # each block's largest value maps to +-127
    error = (q.float() * d[..., None] - x.view(3, 3, 32)).abs()
    assert (error <= d[..., None] * 0.5 * (1 + 1e-6)).all()  # half a step at most


@needs_q8
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 40, 64), (3, 16, 96), (6, 77, 128), (17, 50, 160), (5, 300, 576),
])  # fmt: skip
def test_matches_the_torch_reference(qtype, rows, out_features, in_features):
    weight = _quantized(qtype, out_features, in_features, seed=rows)
    packed = pack_q8_weight(weight)
    x = _activations(rows, in_features, seed=rows + 1)
    bias = torch.randn(out_features)
    residual = torch.randn(rows, out_features)
    want = linear_q8_reference(x, weight)
    # the only rounding left is fp32's over the blocks' scaled sums: bound it by their size
    qx, dx = quantize_rows_q8(x)
    magnitude = (dx.double() * qx.abs().sum(-1).double()) @ (
        weight.dequantize().abs().view(out_features, -1, 32).amax(-1).double().T)
    tolerance = 4e-7 * (magnitude + want.abs()) + 1e-30
    out = linear_q8_native(x, packed, qtype, out_features)
    assert ((out.double() - want).abs() <= tolerance).all()
    fused = linear_q8_native(x, packed, qtype, out_features, bias, residual)
    torch.testing.assert_close(fused, residual + (out + bias), rtol=1e-6, atol=1e-6)


@needs_q8
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_the_batch(qtype):
    weight = _quantized(qtype, 72, 64, seed=5)
    packed = pack_q8_weight(weight)
    x = _activations(37, 64, seed=5)
    full = linear_q8_native(x, packed, qtype, 72)
    for start, count in ((0, 1), (3, 2), (5, 3), (9, 4), (20, 17)):
        part = linear_q8_native(x[start:start + count], packed, qtype, 72)
        assert torch.equal(part, full[start:start + count])


@needs_q8
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_gather_is_exact(qtype):
    weight = _quantized(qtype, 45, 64, seed=1)
    packed = pack_q8_weight(weight)
    ids = torch.tensor([0, 44, 17, 17, 31, 32, 3])
    rows = q8_rows_native(ids, packed, qtype, weight.shape)
    assert torch.equal(rows.view(torch.int32), weight.dequantize()[ids].view(torch.int32))
    with pytest.raises(IndexError, match="45 outside"):
        q8_rows_native(torch.tensor([1, 45]), packed, qtype, weight.shape)


@needs_q8
def test_strided_rows_and_unhandled_inputs():
    weight = _quantized("Q8_0", 20, 64, seed=6)
    packed = pack_q8_weight(weight)
    wide = _activations(4, 128, seed=6)
    out = linear_q8_native(wide[:, 32:96], packed, "Q8_0", 20)  # rows at stride 128
    assert torch.equal(out, linear_q8_native(wide[:, 32:96].contiguous(), packed, "Q8_0", 20))
    assert linear_q8_native(torch.randn(4, 64).double(), packed, "Q8_0", 20) is None
    assert linear_q8_native(torch.randn(4, 64), packed, "Q4_1", 20) is None  # wrong layout
    assert linear_q8_native(torch.randn(4, 48), packed, "Q8_0", 20) is None  # K not in blocks
    assert linear_q8_native(torch.randn(0, 64), packed, "Q8_0", 20).shape == (0, 20)


@needs_q8
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_input_poisons_its_row_alone(bad):
    weight = _quantized("Q4_1", 40, 64, seed=7)
    packed = pack_q8_weight(weight)
    x = _activations(3, 64, seed=7)
    clean = linear_q8_native(x, packed, "Q4_1", 40)
    x[1, 40] = bad
    out = linear_q8_native(x, packed, "Q4_1", 40)
    assert out[1].isnan().all()  # as fp32 would give NaN / inf, never finite garbage
    assert torch.equal(out[[0, 2]], clean[[0, 2]])
