"""Triton write_kv kernel against the torch reference (interpreter on CPU, real GPU on CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.torch_cpu.attention import write_kv_torch  # noqa: E402
from prefixgate.kernels.triton.write_kv import write_kv_triton  # noqa: E402
from tests.kernels.paged_case import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [16, 32])
# (new K/V dtype, cache dtype). NOTE: no fp32 -> bf16 case: Triton's interpreter truncates
# where the GPU (and torch) round to nearest even, so that cast differs by an ulp on CPU.
@pytest.mark.parametrize(
    ("src_dtype", "dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_matches_reference(
    device: str, page_size: int, src_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(page_size)
    num_pages, num_kv_heads, head_dim = 6, 3, 24  # non-power-of-two heads and dim: masked tiles
    # one fused qkv projection, split: key/value are strided views, as in the model
    qkv = torch.randn(11, 3, num_kv_heads, head_dim, generator=gen).to(device, src_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:11]
    slots[[2, 7]] = -1  # already-cached tokens: skipped
    slots = slots.to(device)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_ref = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_ref = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    write_kv_torch(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref)
    assert torch.equal(v_tri, v_ref)
    # the skipped tokens' values landed nowhere
    flat = k_tri.float().flatten(0, 1)
    for skipped in (2, 7):
        assert not (flat == key[skipped].to(dtype).float()).all(dim=(1, 2)).any()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_into_bf16_pages(device: str) -> None:
    """``--kv-dtype bf16`` under an fp32 model: on GPU the same bits as torch (round to nearest
    even); the interpreter truncates, so on CPU within one bf16 ulp."""
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(9, 3, 24, generator=gen).to(device)
    value = torch.randn(9, 3, 24, generator=gen).to(device)
    slots = torch.randperm(6 * 16, generator=gen)[:9].to(device)
    k_ref = torch.zeros(6, 16, 3, 24, dtype=torch.bfloat16, device=device)
    v_ref = torch.zeros_like(k_ref)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    write_kv_torch(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_tri, v_tri, slots)
    if device == "cuda":
        assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    else:
        torch.testing.assert_close(k_tri.float(), k_ref.float(), atol=0, rtol=2**-7)
        torch.testing.assert_close(v_tri.float(), v_ref.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("device", DEVICES)
def test_into_pool_layer_view(device: str) -> None:
    """Writes through kv_pool[l, 0] / kv_pool[l, 1] land only in that layer."""
    pool = torch.zeros(3, 2, 4, 16, 2, 16, device=device)
    key = torch.randn(5, 2, 16, device=device)
    value = torch.randn(5, 2, 16, device=device)
    slots = torch.tensor([0, 15, 16, 63, -1], device=device)
    write_kv_triton(key, value, pool[1, 0], pool[1, 1], slots)
    torch.testing.assert_close(pool[1, 0].flatten(0, 1)[slots[:4]], key[:4])
    torch.testing.assert_close(pool[1, 1].flatten(0, 1)[slots[:4]], value[:4])
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def test_rejects_bad_slot_dtype() -> None:
    cache = torch.zeros(2, 16, 2, 16)
    key = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        write_kv_triton(key, key, cache, cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
