"""Huge-page CPU allocations (kernels/host_memory.py): right shape, no overlap, alive after
the arena goes, plain allocations where huge pages are not to be had."""

from __future__ import annotations

import gc

import pytest
import torch

import kernels.host_memory as hm
from kernels import allocate_kv_pool
from kernels.native_ops import linear_native, pack_linear_weight

HUGE_PAGES_HERE = hm.huge_pages_mode() in ("always", "madvise")


def test_empty_huge_is_an_ordinary_contiguous_tensor() -> None:
    t = hm.empty_huge((3, 1 << 20), torch.float32)  # 12 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * 3 * (1 << 20)
    if HUGE_PAGES_HERE:
        assert t.data_ptr() % hm.HUGE_PAGE == 0


def test_small_and_unsupported_requests_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hm.empty_huge((4, 4), torch.float16)
    assert small.shape == (4, 4) and small.dtype == torch.float16
    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "never")
    plain = hm.empty_huge((1 << 20,), torch.float32)
    assert plain.shape == (1 << 20,)
    arena = hm.HugePageArena(chunk_bytes=4 << 20)
    t = arena.empty((10, 3), torch.float32)
    assert t.shape == (10, 3)


def test_arena_tensors_are_aligned_disjoint_and_outlive_the_arena() -> None:
    arena = hm.HugePageArena(chunk_bytes=4 << 20)
    shapes = [(17,), (1000, 3), (64, 64), (300_000,), (5,), (200_000, 2)]  # spills into a 2nd chunk
    tensors = [arena.empty(shape, torch.float32) for shape in shapes]
    tensors.append(arena.empty((3 << 20,), torch.float32))  # 12 MB > half a chunk: its own
    for i, t in enumerate(tensors):
        assert t.is_contiguous() and t.data_ptr() % hm.HugePageArena.ALIGN == 0
        t.fill_(float(i))
    del arena
    gc.collect()
    for i, t in enumerate(tensors):  # nothing overwrote anything
        assert bool((t == float(i)).all())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


class _DirtyArena(hm.HugePageArena):
    """Hands out memory full of NaN, as reused memory may be."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype)


def test_packed_weight_from_an_arena_pads_with_zeros() -> None:
    torch.manual_seed(0)
    weight = torch.randn(20, 12)  # a partial second block of 4 columns
    packed = pack_linear_weight(weight, _DirtyArena())
    if packed is None:
        pytest.skip("native linear not available here")
    assert not torch.isnan(packed).any()
    assert torch.equal(packed, pack_linear_weight(weight))
    x = torch.randn(3, 12)
    torch.testing.assert_close(linear_native(x, packed, 20), x @ weight.t(), atol=1e-5, rtol=1e-5)


def test_cpu_kv_pool_is_zeroed_huge_page_memory() -> None:
    pool = allocate_kv_pool(2, 64, 16, 2, 64, torch.float32, "cpu")  # 2 MB
    assert pool.shape == (2, 2, 64, 16, 2, 64) and pool.is_contiguous()
    assert int(torch.count_nonzero(pool)) == 0
    if HUGE_PAGES_HERE:
        assert pool.data_ptr() % hm.HUGE_PAGE == 0
