"""The bf16 linear (kernels/cpu/csrc/linear_bf16.c), the GEMM of the CPU bf16 mode: on both of
its paths (AVX512-BF16 vectors, AMX tiles) it equals the fp64 product of the bf16-rounded inputs
up to fp32 summation, with the fp32 bias and residual; a row's result does not depend on the
other rows of the call; it declines what it does not take."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.cpu.ops import (
    bf16_native_available,
    linear_bf16_native,
    pack_bf16_weight,
    quant_amx_available,
)

NO_AMX = 1 << 30  # amx_min_rows that keeps every call on the vector path
PATHS = [pytest.param(NO_AMX, id="avx512bf16"),
         pytest.param(1, id="amx", marks=pytest.mark.skipif(
             not quant_amx_available(), reason="no AMX-BF16 here (CPU, build or kernel)"))]

pytestmark = pytest.mark.skipif(
    not bf16_native_available(), reason="native bf16 linear not built here (no AVX512-BF16)"
)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias, residual) -> tuple[torch.Tensor, ...]:
    """The exact product of the bf16-rounded inputs (fp64), and sum |x| |w| per output."""
    xb, wb = x.bfloat16().double(), weight.bfloat16().double()
    out = xb @ wb.T
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out, xb.abs() @ wb.abs().T


@pytest.mark.parametrize("amx_min_rows", PATHS)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 576, 576), (3, 37, 100), (8, 960, 576), (16, 3072, 576), (33, 50, 64), (300, 576, 1536)],
)
def test_matches_the_exact_product_of_bf16_inputs(amx_min_rows, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    packed = pack_bf16_weight(weight)
    for b, r in ((None, None), (bias, residual)):
        out = linear_bf16_native(x, packed, out_features, b, r, amx_min_rows=amx_min_rows)
        assert out is not None and out.dtype == torch.float32
        exact, scale = _reference(x, weight, b, r)
        # fp32 sums of exact bf16 products: a few ulps of fp32 over sum |x| |w|
        assert float(((out.double() - exact).abs() / scale).max()) < 1e-6


@pytest.mark.parametrize("amx_min_rows", PATHS)
def test_rows_do_not_depend_on_the_batch(amx_min_rows):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 192, generator=generator)
    x = torch.randn(21, 192, generator=generator)
    packed = pack_bf16_weight(weight)
    batched = linear_bf16_native(x, packed, 200, amx_min_rows=amx_min_rows)
    for row in (0, 7, 20):
        alone = linear_bf16_native(x[row : row + 1], packed, 200, amx_min_rows=amx_min_rows)
        assert torch.equal(alone[0], batched[row])


def test_strided_rows_and_declines():
    weight = torch.randn(40, 64)
    packed = pack_bf16_weight(weight)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows at a stride, dense within a row
    out = linear_bf16_native(x, packed, 40)
    exact, scale = _reference(x, weight, None, None)
    assert float(((out.double() - exact).abs() / scale).max()) < 1e-6
    assert linear_bf16_native(x.double(), packed, 40) is None  # not fp32
    assert linear_bf16_native(torch.randn(5, 96), packed, 40) is None  # another in_features
    assert linear_bf16_native(x.t().contiguous().t(), packed, 40) is None  # column-strided
    assert linear_bf16_native(x, packed, 40, residual=torch.randn(5, 41)) is None
    assert linear_bf16_native(torch.randn(0, 64), packed, 40).shape == (0, 40)
