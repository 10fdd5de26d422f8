"""The MXFP4 linear kernel (kernels/cpu/csrc/linear_mxfp4.c) against the expanded reference
(dequantize, then an fp32 matmul), every path this machine builds (AVX-512, AVX2, plain C), and
the torch format code (kernels/torch_cpu/mxfp4.py) against gguf-py's and transformers' own.

The bound: the kernel's weights are exact, its activations fp32; only the order of the fp32 sums
differs from the reference, so ``|ours - ref| <= K * 2^-24 * sum_k |x_k w_k|`` per output (the
textbook bound for a K-term fp32 dot product, tests use it with 2x slack over the double-
precision product).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixgate.kernels.cpu.mxfp4 import (
    PATH_AVX2,
    PATH_AVX512,
    PATH_C,
    Mxfp4Linear,
    linear_mxfp4,
    mxfp4_native_path,
)
from prefixgate.kernels.torch_cpu.mxfp4 import (
    Mxfp4Tensor,
    cat_rows_mxfp4,
    linear_mxfp4_reference,
    quantize_mxfp4,
)

native = pytest.mark.skipif(mxfp4_native_path() is None, reason="no native CPU library here")


def _weight(rows: int, cols: int, seed: int = 0) -> Mxfp4Tensor:
    generator = torch.Generator().manual_seed(seed)
    # scales over a wide range, as real checkpoints have
    w = torch.randn(rows, cols, generator=generator) * torch.exp2(
        torch.randint(-8, 4, (rows, cols // 32, 1), generator=generator).float()
    ).repeat_interleave(32, -1).reshape(rows, cols)
    return quantize_mxfp4(w)


def _bound(x: torch.Tensor, weight: Mxfp4Tensor) -> torch.Tensor:
    magnitude = x.double().abs() @ weight.dequantize().double().abs().T
    return 2 * weight.shape[1] * 2.0**-24 * magnitude + 1e-30


def _paths() -> list[int]:
    best = mxfp4_native_path() or 0
    return [p for p in (PATH_C, PATH_AVX2, PATH_AVX512) if p <= best]


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("out_features,cols", [(7, 32), (64, 96), (130, 2880 // 10 * 2)])
def test_every_path_matches_the_expanded_reference_within_the_fp32_bound(rows, out_features,
                                                                         cols):
    weight = _weight(out_features, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    bound = _bound(x, weight)
    for path in _paths():
        ours = linear_mxfp4(x, weight, bias, path=path).double()
        excess = ((ours - exact).abs() - bound).max().item()
        assert excess <= 0, f"path {path}: {excess} over the bound"
    reference = linear_mxfp4_reference(x, weight, bias).double()
    assert ((reference - exact).abs() <= bound).all()


@native
def test_a_row_is_bit_identical_alone_and_batched_and_strided():
    weight = _weight(72, 128)
    x = torch.randn(11, 256)[:, :128]  # a row stride of 256
    for path in _paths():
        batched = linear_mxfp4(x, weight, path=path)
        for i in (0, 4, 10):
            assert torch.equal(linear_mxfp4(x[i : i + 1], weight, path=path)[0], batched[i])


@native
def test_the_paths_this_machine_has_are_built_and_a_missing_one_is_refused():
    assert mxfp4_native_path() in (PATH_C, PATH_AVX2, PATH_AVX512)
    if mxfp4_native_path() < PATH_AVX512:
        with pytest.raises(RuntimeError, match="not built"):
            linear_mxfp4(torch.zeros(1, 32), _weight(4, 32), path=PATH_AVX512)
    with pytest.raises(ValueError, match="fp32"):
        linear_mxfp4(torch.zeros(1, 64), _weight(4, 32))


def test_the_layer_falls_back_to_the_reference_and_keeps_the_dtype():
    weight, bias = _weight(16, 64), torch.randn(16)
    x = torch.randn(3, 64)
    layer = Mxfp4Linear([weight], bias, native=False)
    assert torch.equal(layer(x), linear_mxfp4_reference(x, weight, bias))
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@native
def test_a_layer_of_two_parts_writes_each_into_its_columns_without_a_copy():
    gate, up, bias = _weight(24, 64, seed=1), _weight(40, 64, seed=2), torch.randn(64)
    x = torch.randn(5, 64)
    layer = Mxfp4Linear([gate, up], bias, native=True)
    assert layer.native and layer.parts[0] is gate and layer.parts[1] is up
    both = cat_rows_mxfp4([gate, up])
    assert torch.equal(layer(x), linear_mxfp4(x, both, bias))
    expected = linear_mxfp4_reference(x, both, bias)
    assert ((layer(x) - expected).abs() <= _bound(x, both).float() + 1e-6).all()
    assert torch.allclose(Mxfp4Linear([gate, up], bias, native=False)(x), expected)


def test_the_quantizer_and_dequantizer_are_gguf_pys_bit_for_bit():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = torch.randn(12, 128) * 3
    w[0, :32] = 0  # an all-zero block
    ours = quantize_mxfp4(w)
    theirs = quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    assert np.array_equal(ours.to_gguf().numpy(), theirs)
    expanded = dequantize(theirs, GGMLQuantizationType.MXFP4)
    assert np.array_equal(ours.dequantize().numpy(), expanded)
    again = Mxfp4Tensor.from_gguf(torch.from_numpy(theirs), (12, 128))
    assert torch.equal(again.nibbles, ours.nibbles) and torch.equal(again.scales, ours.scales)


def test_hf_blocks_read_as_transformers_reads_them():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = _weight(2 * 24, 64)  # one expert's [out, in]
    blocks, scales = weight.to_hf()
    # transformers: [E, out, G, 16] -> [E, in, out] (its gate_up_proj layout)
    theirs = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0]
    assert torch.equal(theirs.T, weight.dequantize())
    again = Mxfp4Tensor.from_hf(blocks, scales)
    assert torch.equal(again.nibbles, weight.nibbles)


def test_a_malformed_matrix_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Mxfp4Tensor(torch.zeros(2, 1, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8),
                    (2, 48))


def test_on_another_device_the_matrix_is_expanded_once_in_the_compute_dtype():
    weight, bias = _weight(16, 64), torch.randn(16)
    layer = Mxfp4Linear([weight], bias, native=True, device="meta", dtype=torch.bfloat16)
    assert not layer.native and layer.parts == ()
    assert layer.expanded.device.type == "meta" and layer.expanded.dtype == torch.bfloat16
    out = layer(torch.empty(3, 64, device="meta", dtype=torch.bfloat16))
    assert out.shape == (3, 16) and out.dtype == torch.bfloat16
