"""The fused native layer ops (kernels/cpu/csrc/cpu_ops.c) against their torch versions."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from prefixgate.kernels.cpu.ops import (
    linear_native,
    pack_linear_weight,
    rms_norm_native,
    rope_native,
    silu_mul_native,
    write_kv_native,
)
from prefixgate.kernels.torch_cpu.attention import write_kv_torch

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)

FP32 = {"atol": 2e-6, "rtol": 2e-6}


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).float()


# 1 row (decode), a few, and enough rows x dims to take the OpenMP path
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 64), (300, 576)])
def test_rms_norm_matches_torch_on_strided_rows(rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    wide = torch.randn(rows, dim + 40) * 3
    x = wide[:, 7 : 7 + dim]  # rows at a stride, as a slice of a wider activation
    weight = torch.rand(dim) + 0.5
    out = rms_norm_native(x, weight, 1e-5)
    assert out is not None and out.is_contiguous()
    torch.testing.assert_close(out, _torch_rms_norm(x, weight, 1e-5), **FP32)
    # eps matters for tiny rows; zeros stay finite
    zeros = rms_norm_native(torch.zeros(2, dim), weight, 1e-5)
    assert zeros is not None and torch.equal(zeros, torch.zeros(2, dim))


# decode rows, and enough rows x heads x dims to take the OpenMP path
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_head_norm_norms_q_and_k_heads_in_place_and_leaves_v(rows: int) -> None:
    """Qwen3's per-head q/k norms on the q|k view of a fused q|k|v row (kernels/cpu/ops.py:
    NativeHeadNorm, bound through the registry): q heads with one weight, k heads with the
    other, v and the row's other columns untouched."""
    from prefixgate.kernels.cpu.ops import NativeHeadNorm

    torch.manual_seed(rows)
    heads, kv_heads, dim = 6, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim) * 3
    before = qkv.clone()
    q_weight, k_weight = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    out = NativeHeadNorm(q_weight, k_weight, 1e-6, heads, kv_heads)(qk)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    view = before[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    weight = torch.cat([q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)])
    torch.testing.assert_close(out, _torch_rms_norm(view, weight, 1e-6), **FP32)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_silu_mul_matches_torch(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    out = silu_mul_native(gate_up)
    assert out is not None and out.shape == (rows, 1536)
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(out, expected, **FP32)


@pytest.mark.parametrize("rows", [1, 4, 200])
def test_rope_rotates_in_place_like_torch(rows: int) -> None:
    from prefixgate.engine.models.rope import RotaryEmbedding

    torch.manual_seed(rows)
    heads_q, heads_kv, head_dim = 9, 3, 64
    width = (heads_q + 2 * heads_kv) * head_dim
    qkv = torch.randn(rows, width)
    qk = qkv[:, : (heads_q + heads_kv) * head_dim].view(rows, -1, head_dim)
    angles = torch.rand(rows, 1, head_dim // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    expected = RotaryEmbedding.rotate(qk, cos, sin)
    v_before = qkv[:, (heads_q + heads_kv) * head_dim :].clone()
    assert rope_native(qk, cos, sin)
    torch.testing.assert_close(qk, expected, **FP32)
    assert torch.equal(qkv[:, (heads_q + heads_kv) * head_dim :], v_before)  # V untouched


def test_write_kv_matches_the_torch_scatter_and_skips_minus_one() -> None:
    torch.manual_seed(0)
    num_pages, page_size, heads, head_dim = 6, 4, 3, 8
    k_cache = torch.full((num_pages, page_size, heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    qkv = torch.randn(5, 3 * heads * head_dim)  # k/v as strided views of a fused output
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(5, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim :].view(5, heads, head_dim)
    slots = torch.tensor([23, 0, -1, 9, 10])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_torch(key, value, k_ref, v_ref, slots)
    assert write_kv_native(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@pytest.mark.parametrize("bad", [24, -2, 1 << 40])
def test_write_kv_bad_slot_is_an_error_and_writes_nothing(bad: int) -> None:
    k_cache = torch.zeros(6, 4, 3, 8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 3, 8)
    slots = torch.tensor([1, 2, bad])  # the bad slot comes last: earlier rows are not written
    with pytest.raises(ValueError, match="slot outside"):
        write_kv_native(key, key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot outside"):
        write_kv_torch(key, key, k_cache, v_cache, slots, use_native=True)
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0


def test_what_the_native_ops_do_not_handle_is_declined_untouched() -> None:
    x16 = torch.randn(4, 64, dtype=torch.bfloat16)
    assert rms_norm_native(x16, torch.ones(64, dtype=torch.bfloat16), 1e-5) is None
    assert rms_norm_native(torch.randn(4, 64).t(), torch.ones(4), 1e-5) is None  # strided dim
    assert rms_norm_native(torch.randn(4, 64), torch.ones(32), 1e-5) is None  # wrong weight
    assert silu_mul_native(torch.randn(4, 7)) is None  # odd width
    assert silu_mul_native(torch.randn(2, 4, 8)) is None
    x = torch.randn(3, 2, 8)
    before = x.clone()
    cos = torch.ones(3, 1, 4)
    rows_t = x.transpose(0, 1)  # [2, 3, 8]: heads 24 floats apart, not dense in a row
    assert not rope_native(rows_t, cos[:2], cos[:2])
    assert not rope_native(x, torch.ones(2, 1, 4), cos)  # a table row short
    assert not rope_native(x[:1].expand(3, 2, 8), cos, cos)  # rows overlap (stride 0)
    assert torch.equal(x, before)
    x64 = x.double()
    assert not rope_native(x64, cos.double(), cos.double())
    assert torch.equal(x64, before.double())
    k_cache = torch.zeros(2, 4, 2, 8)
    slots = torch.tensor([0, 1, 2])
    assert not write_kv_native(x, x, k_cache, k_cache.clone(), slots.int())
    strided_key = torch.randn(3, 8, 2).transpose(1, 2)  # right shape, head dim not dense
    assert not write_kv_native(strided_key, x, k_cache, k_cache.clone(), slots)
    assert not write_kv_native(x, x, k_cache.half(), k_cache.half(), slots)  # fp16 pages
    assert not write_kv_native(x, x, k_cache.bfloat16(), k_cache.clone(), slots)  # mixed pages
    assert not write_kv_native(x.bfloat16(), x.bfloat16(), k_cache.bfloat16(),
                               k_cache.bfloat16(), slots)  # bf16 rows
    assert k_cache.abs().sum() == 0


def test_write_kv_into_bf16_pages_rounds_like_torch() -> None:
    """fp32 K/V into bf16 pages (``--kv-dtype bf16``): the same bits as ``.to(bfloat16)``
    (round to nearest even), ties, subnormals, infinities and the largest finite values
    included; slot -1 skipped."""
    torch.manual_seed(1)
    num_pages, page_size, heads, head_dim = 6, 4, 3, 8
    k_cache = torch.full((num_pages, page_size, heads, head_dim), 5.0, dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, -5.0)
    qkv = torch.randn(5, 3 * heads * head_dim) * torch.logspace(-40, 38, 5)[:, None]
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF,
                         0x7F800000, 0xFF800000, 0x3F80FFFF], dtype=torch.int64)
    qkv[0, :8] = bits.to(torch.int32).view(torch.float32)  # ties to even, edge magnitudes
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(5, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim :].view(5, heads, head_dim)
    key[0, 0] = qkv[0, :8]
    slots = torch.tensor([23, 0, -1, 9, 10])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_torch(key, value, k_ref, v_ref, slots)
    assert write_kv_native(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.int16), k_ref.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), v_ref.view(torch.int16))
    assert (k_cache.flatten(0, 1)[[1, 2, 3, 4, 5, 6, 7, 8, 11]] == 5.0).all()  # untouched slots



@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 16, 8), (17, 50, 33), (32, 3072, 576)])
def test_linear_matches_a_float64_reference(rows: int, out_features: int, in_features: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features)
    bias, residual = torch.randn(out_features), torch.randn(rows, out_features)
    x = torch.randn(rows, in_features)
    packed = pack_linear_weight(weight)
    assert packed is not None and packed.shape == (-(-out_features // 16), in_features, 16)
    assert torch.all(packed.transpose(1, 2).reshape(-1, in_features)[out_features:] == 0)  # padding
    expected = (x.double() @ weight.double().t() + bias.double() + residual.double()).float()
    out = linear_native(x, packed, out_features, bias, residual)
    assert out is not None
    torch.testing.assert_close(out, expected, atol=2e-5 * in_features**0.5, rtol=1e-5)


def test_linear_declines_what_it_does_not_take() -> None:
    packed = pack_linear_weight(torch.randn(32, 8))
    assert packed is not None
    assert linear_native(torch.randn(4, 8).t().contiguous().t(), packed, 32) is None  # strided
    assert linear_native(torch.randn(4, 7), packed, 32) is None  # wrong in_features
    assert linear_native(torch.randn(4, 8), packed, 33) is None  # more outputs than packed
    assert linear_native(torch.randn(4, 8).double(), packed, 32) is None
    assert linear_native(torch.randn(4, 8), packed, 32, bias=torch.randn(31)) is None
    assert linear_native(torch.randn(4, 8), packed, 32, residual=torch.randn(3, 32)) is None
    assert pack_linear_weight(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    assert linear_native(torch.randn(4, 8), torch.randn(2, 8, 8), 16) is None  # not 16 columns
    assert linear_native(torch.randn(4, 8), packed.transpose(0, 1).contiguous().transpose(0, 1), 32) is None
    # a size-1 dimension may have any stride
    w1 = torch.randn(3, 1)
    x1 = torch.randn(1, 6).t()  # [6, 1], stride (1, 6)
    torch.testing.assert_close(linear_native(x1, pack_linear_weight(w1), 3), x1 @ w1.t())


def test_linear_leaves_the_next_row_alone_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial column block computed on one thread: nothing spills into the next row."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    weight = torch.randn(20, 12)  # 16 + 4 columns
    packed = pack_linear_weight(weight)
    x = torch.randn(3, 12)
    torch.testing.assert_close(linear_native(x, packed, 20), x @ weight.t(), atol=1e-5, rtol=1e-5)
