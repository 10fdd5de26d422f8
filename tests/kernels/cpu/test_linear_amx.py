"""The AMX path of the quantized linear (kernels/cpu/csrc/linear_amx.c): as close to the exact
(fp64) product as the vector-register kernel, on random and on the default model's weights; the
activations' three bf16 parts lose nothing; rows do not depend on their batch; and where AMX
is missing or declines, the register kernel runs, bit for bit as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from prefixgate.kernels.cpu import ops
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.ops import (
    QUANT_AMX_MIN_ROWS,
    linear_quant_native,
    pack_quant_weight,
    quant_amx_available,
    quant_native_available,
)
from prefixgate.kernels.quant import QuantizedTensor, cat_rows

QTYPES = ("Q4_0", "Q4_1", "Q8_0")
NO_AMX = 1 << 30  # amx_min_rows that keeps every call on the register kernel

needs_native = pytest.mark.skipif(
    not quant_native_available(), reason="native quantized kernel not built here (no AVX-512)"
)
needs_amx = pytest.mark.skipif(
    not quant_amx_available(), reason="no AMX-BF16 here (CPU, build or kernel permission)"
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


def _identity(qtype: str, size: int) -> QuantizedTensor:
    """W = I (size x size) in ggml blocks: d = 1 (m = 0), one quant of 1 per row."""
    groups = size // 32
    if qtype == "Q8_0":
        blocks = np.zeros((size, groups, 34), np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
        for n in range(size):
            blocks[n, n // 32, 2 + n % 32] = 1
    else:
        head = 2 if qtype == "Q4_0" else 4
        zero = 8 if qtype == "Q4_0" else 0  # Q4_0 weight = d (q - 8); Q4_1: d q + m
        blocks = np.zeros((size, groups, head + 16), np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
        blocks[..., head:] = zero | zero << 4
        for n in range(size):
            j = n % 32
            byte = blocks[n, n // 32, head + j % 16]
            nibble = zero + 1
            byte = (byte & 0xF0) | nibble if j < 16 else (byte & 0x0F) | nibble << 4
            blocks[n, n // 32, head + j % 16] = byte
    data = torch.from_numpy(blocks.reshape(size, -1))
    weight = QuantizedTensor(qtype, data, (size, size))
    assert torch.equal(weight.dequantize(), torch.eye(size))
    return weight


def _normalized_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> float:
    """max |out - exact| / (|x| |W|^T + |bias| + |residual|), the exact result in fp64: the
    error relative to what the rounding of a dot product is measured against."""
    w64 = weight.double()
    exact, scale = x.double() @ w64.T, x.double().abs() @ w64.abs().T
    for extra in (bias, residual):
        if extra is not None:
            exact, scale = exact + extra.double(), scale + extra.double().abs()
    return ((out.double() - exact).abs() / scale.clamp_min(1e-300)).max().item()


def _amx(x, packed, qtype, n, bias=None, residual=None) -> torch.Tensor:
    return linear_quant_native(x, packed, qtype, n, bias, residual, amx_min_rows=1)


def _registers(x, packed, qtype, n, bias=None, residual=None) -> torch.Tensor:
    return linear_quant_native(x, packed, qtype, n, bias, residual, amx_min_rows=NO_AMX)


def test_availability_follows_the_cpu():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = set(next((line for line in lines if line.startswith("flags")), "").split())
    if quant_amx_available():
        assert {"amx_tile", "amx_bf16"} <= flags
    if "amx_bf16" not in flags:
        assert not quant_amx_available()


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_three_parts_give_back_every_activation_bit(qtype):
    # x W^T with W = I is one exact product per output: any bit a part lost would show
    generator = torch.Generator().manual_seed(1)
    size = 96
    x = torch.randn(19, size, generator=generator) * torch.exp2(
        torch.randint(-60, 60, (19, size), generator=generator).float()
    )
    packed = pack_quant_weight(_identity(qtype, size))
    for rows in (1, 7, 16, 19):  # one tile of each height, and a padded second tile
        out = _amx(x[:rows], packed, qtype, size)
        assert torch.equal(out.view(torch.int32), x[:rows].view(torch.int32))


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [
    (1, 40, 64), (3, 16, 32), (4, 77, 128), (16, 50, 160), (17, 300, 576), (40, 96, 1536),
    (64, 33, 96),
])  # fmt: skip
def test_as_close_to_fp64_as_the_register_kernel(qtype, rows, out_features, in_features):
    # out_features: chunks of 3, 2 and 1 column blocks; in_features: fewer groups than the fold
    # lags behind (32), and the model's widths
    weight = _quantized(qtype, out_features, in_features, seed=rows)
    packed = pack_quant_weight(weight)
    values = weight.dequantize()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    for bias_, residual_ in ((None, None), (bias, None), (None, residual), (bias, residual)):
        amx = _amx(x, packed, qtype, out_features, bias_, residual_)
        ref = _registers(x, packed, qtype, out_features, bias_, residual_)
        assert amx.shape == (rows, out_features) and amx.dtype == torch.float32
        amx_error = _normalized_error(amx, x, values, bias_, residual_)
        ref_error = _normalized_error(ref, x, values, bias_, residual_)
        # within 2x of the fp32 kernel's own rounding (one ulp of fp32 at least)
        assert amx_error <= 2 * max(ref_error, 2.0**-24), (amx_error, ref_error)


@needs_amx
def test_on_the_default_models_weights(loaded_model):
    # activations with outlier channels, as in a real residual stream
    weights = loaded_model.weights
    layer = "model.layers.7."
    matrices = [
        cat_rows([weights[layer + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
        weights[layer + "mlp.down_proj.weight"],
        weights.get("lm_head.weight", weights["model.embed_tokens.weight"]),  # Q8_0
    ]
    generator = torch.Generator().manual_seed(7)
    for weight in matrices:
        n, k = weight.shape
        x = torch.randn(16, k, generator=generator)
        x[:, torch.randperm(k, generator=generator)[:4]] *= 60
        packed = pack_quant_weight(weight)
        values = weight.dequantize()
        for rows in (5, 16):
            amx = _amx(x[:rows], packed, weight.qtype, n)
            ref = _registers(x[:rows], packed, weight.qtype, n)
            amx_error = _normalized_error(amx, x[:rows], values)
            ref_error = _normalized_error(ref, x[:rows], values)
            assert amx_error <= 2 * max(ref_error, 2.0**-24), (weight.qtype, amx_error, ref_error)


@needs_amx
def test_rows_do_not_depend_on_the_batch():
    weight = _quantized("Q4_1", 200, 576, seed=5)
    packed = pack_quant_weight(weight)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5))
    full = _amx(x, packed, "Q4_1", 200)
    for count in (1, 2, 7, 16, 17, 33):
        assert torch.equal(_amx(x[:count], packed, "Q4_1", 200), full[:count])
    assert torch.equal(_amx(x[20:21], packed, "Q4_1", 200), full[20:21])


@needs_native
def test_the_row_count_picks_the_kernel():
    weight = _quantized("Q8_0", 48, 64, seed=2)
    packed = pack_quant_weight(weight)
    x = torch.randn(QUANT_AMX_MIN_ROWS, 64, generator=torch.Generator().manual_seed(2))
    few = x[: QUANT_AMX_MIN_ROWS - 1]
    assert torch.equal(
        linear_quant_native(few, packed, "Q8_0", 48), _registers(few, packed, "Q8_0", 48)
    )
    expected = _amx if quant_amx_available() else _registers
    assert torch.equal(linear_quant_native(x, packed, "Q8_0", 48), expected(x, packed, "Q8_0", 48))


@needs_native
def test_without_amx_the_register_kernel_runs(monkeypatch):
    weight = _quantized("Q4_1", 77, 128, seed=3)
    packed = pack_quant_weight(weight)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(3))
    residual = torch.randn(24, 77, generator=torch.Generator().manual_seed(4))
    expected = _registers(x, packed, "Q4_1", 77, None, residual)
    # no AMX on this CPU / kernel (what quant_amx_available reports there)
    monkeypatch.setattr(ops, "quant_amx_available", lambda: False)
    assert torch.equal(_amx(x, packed, "Q4_1", 77, None, residual), expected)
    monkeypatch.undo()
    if not quant_amx_available():
        return
    # the AMX kernel declines at run time (its -1: nothing written): the register kernel runs
    lib = library()
    calls = []

    def declines(*args):
        calls.append(args)
        return -1

    monkeypatch.setattr(lib, "pg_linear_quant_amx_f32", declines)
    assert torch.equal(_amx(x, packed, "Q4_1", 77, None, residual), expected)
    assert len(calls) == 1


@needs_amx
def test_a_reloaded_library_still_runs_on_tiles():
    # the library is rebuilt and reloaded when its cache is cleared: the AMX entry point of the
    # new handle must be declared too (an undeclared one took 64-bit pointers as C ints)
    size = 64
    x = torch.randn(16, size, generator=torch.Generator().manual_seed(3))
    packed = pack_quant_weight(_identity("Q8_0", size))
    library.cache_clear()
    try:
        assert quant_amx_available()
        assert torch.equal(_amx(x, packed, "Q8_0", size), x)
    finally:
        library.cache_clear()
