"""The weight-only quantized linear (kernels/cpu/csrc/linear_quant.c) against torch on the exactly
dequantized weights, and that dequantization against gguf's own, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from prefixgate.kernels.cpu.ops import (
    linear_quant_native,
    pack_quant_weight,
    quant_native_available,
    quant_rows_native,
)
from prefixgate.kernels.quant import QuantizedTensor, cat_rows

QTYPES = ("Q4_0", "Q4_1", "Q8_0")

needs_native = pytest.mark.skipif(
    not quant_native_available(), reason="native quantized kernel not built here (no AVX-512)"
)


def _quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """A random matrix quantized by gguf (scales of very different sizes across blocks)."""
    generator = np.random.default_rng(seed)
    values = generator.standard_normal((rows, cols)).astype(np.float32)
    values *= np.exp(generator.uniform(-6, 2, size=(rows, cols // 32, 1))).repeat(32, -1).reshape(
        rows, cols
    )
    data = quantize(values, GGMLQuantizationType[qtype])
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(data)), (rows, cols))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_ggufs_bit_for_bit(qtype):
    weight = _quantized(qtype, 37, 96)
    ours = weight.dequantize()
    theirs = dequantize(weight.data.numpy(), GGMLQuantizationType[qtype])
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_gather_is_exact(qtype):
    weight = _quantized(qtype, 45, 64, seed=1)
    packed = pack_quant_weight(weight)
    ids = torch.tensor([0, 44, 17, 17, 31, 32, 3])
    rows = quant_rows_native(ids, packed, qtype, weight.shape)
    assert torch.equal(rows.view(torch.int32), weight.dequantize()[ids].view(torch.int32))
    with pytest.raises(IndexError, match="45 outside"):
        quant_rows_native(torch.tensor([1, 45]), packed, qtype, weight.shape)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 40, 64), (3, 16, 96), (17, 77, 128), (64, 50, 160), (5, 300, 576),
])  # fmt: skip
def test_matches_torch_on_the_dequantized_weights(qtype, rows, out_features, in_features):
    weight = _quantized(qtype, out_features, in_features, seed=rows)
    packed = pack_quant_weight(weight)
    reference = weight.dequantize().double()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    expected = x.double() @ reference.T
    scale = (x.double().abs() @ reference.abs().T).max().item()
    for bias_, residual_ in ((None, None), (bias, None), (None, residual), (bias, residual)):
        want = expected.clone()
        if bias_ is not None:
            want += bias_.double()
        if residual_ is not None:
            want += residual_.double()
        # both paths of this kernel: registers (decode) and the fp32 scratch tile (prefill);
        # the AMX kernel, grouped differently, is bounded against fp64 in test_linear_amx.py
        outs = [
            linear_quant_native(x, packed, qtype, out_features, bias_, residual_,
                                scratch_min_rows=limit, amx_min_rows=1 << 30)
            for limit in (1 << 30, 0)
        ]  # fmt: skip
        for out in outs:
            assert out.shape == (rows, out_features) and out.dtype == torch.float32
            assert (out.double() - want).abs().max().item() <= 1e-5 * scale + 1e-6
        # same summation order on both paths: bit-identical, whatever the batch
        assert torch.equal(outs[0], outs[1])


@needs_native
def test_rows_do_not_depend_on_the_batch():
    weight = _quantized("Q4_1", 48, 64, seed=5)
    packed = pack_quant_weight(weight)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(5))
    # within this kernel (the AMX one keeps the property among its own row counts)
    full = linear_quant_native(x, packed, "Q4_1", 48, amx_min_rows=1 << 30)
    for count in (1, 2, 7, 16):
        part = linear_quant_native(x[:count], packed, "Q4_1", 48, amx_min_rows=1 << 30)
        assert torch.equal(part, full[:count])


@needs_native
def test_strided_rows_and_unhandled_inputs():
    weight = _quantized("Q8_0", 20, 64, seed=6)
    packed = pack_quant_weight(weight)
    wide = torch.randn(4, 100)
    out = linear_quant_native(wide[:, 10:74], packed, "Q8_0", 20)  # rows at stride 100
    want = wide[:, 10:74].double() @ weight.dequantize().double().T
    assert (out.double() - want).abs().max().item() < 1e-4
    assert linear_quant_native(torch.randn(4, 64).double(), packed, "Q8_0", 20) is None
    assert linear_quant_native(torch.randn(4, 64), packed, "Q4_1", 20) is None  # wrong layout
    assert linear_quant_native(torch.randn(4, 64).t().contiguous().t(), packed, "Q8_0", 20) is None


def test_cat_rows_keeps_the_values():
    parts = [_quantized("Q4_1", n, 64, seed=n) for n in (3, 16, 5)]
    fused = cat_rows(parts)
    assert fused.shape == (24, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="same quantization"):
        cat_rows([parts[0], _quantized("Q8_0", 3, 64)])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedTensor("Q4_1", torch.zeros(2, 19, dtype=torch.uint8), (2, 32))
    with pytest.raises(ValueError, match="not supported"):
        QuantizedTensor("Q5_0", torch.zeros(2, 22, dtype=torch.uint8), (2, 32))
