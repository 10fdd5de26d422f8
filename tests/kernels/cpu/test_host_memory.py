"""Huge-page CPU allocations (kernels/cpu/host_memory.py): advised, aligned, right shape, no
overlap, alive after the arena goes, plain allocations where huge pages are not to be had."""

from __future__ import annotations

import contextlib
import gc
import mmap

import pytest
import torch

import prefixgate.kernels.cpu.host_memory as hm
import prefixgate.kernels.layout as layout
from prefixgate.kernels import allocate_kv_pool
from prefixgate.kernels.cpu.ops import linear_native, pack_linear_weight


@pytest.fixture
def advice(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """THP in madvise mode whatever the host says; records each advised (address, length)
    (still advising for real where the host takes it)."""
    calls: list[tuple[int, int]] = []

    def record(region: mmap.mmap, offset: int, length: int) -> None:
        base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
        calls.append((base + offset, length))
        with contextlib.suppress(AttributeError, OSError):
            region.madvise(mmap.MADV_HUGEPAGE, offset, length)

    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "madvise")
    monkeypatch.setattr(hm, "_advice_failed", False)
    monkeypatch.setattr(hm, "_advise", record)
    return calls


def _inside(t: torch.Tensor, call: tuple[int, int]) -> bool:
    start, length = call
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + length


def test_empty_huge_is_advised_aligned_and_usable(advice: list[tuple[int, int]]) -> None:
    t = hm.empty_huge((3, 1 << 20), torch.float32)  # 12 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert len(advice) == 1 and advice[0][0] % hm.HUGE_PAGE == 0
    assert advice[0][1] % hm.HUGE_PAGE == 0 and _inside(t, advice[0])
    assert t.data_ptr() == advice[0][0]
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * 3 * (1 << 20)
    half = hm.empty_huge((3, 1 << 18), torch.float16)  # 1.5 MB: below one huge page, plain
    assert half.shape == (3, 1 << 18) and half.dtype == torch.float16 and len(advice) == 1


def test_unsupported_hosts_get_plain_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "never")
    monkeypatch.setattr(hm, "_advise", lambda *a: pytest.fail("advised with THP off"))
    assert hm.empty_huge((1 << 20,), torch.float32).shape == (1 << 20,)
    assert hm.HugePageArena(chunk_bytes=4 << 20).empty((10, 3), torch.float32).shape == (10, 3)


def test_a_refused_advice_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse(*args: object) -> None:
        calls.append(args)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "madvise")
    monkeypatch.setattr(hm, "_advice_failed", False)
    monkeypatch.setattr(hm, "_advise", refuse)
    for _ in range(3):
        t = hm.empty_huge((1 << 20,), torch.float32)
        t.fill_(1.0)
        assert float(t.sum()) == 1 << 20
    assert len(calls) == 1


def test_arena_tensors_are_aligned_disjoint_and_outlive_the_arena(
    advice: list[tuple[int, int]],
) -> None:
    arena = hm.HugePageArena(chunk_bytes=4 << 20)
    shapes = [(17,), (1000, 3), (64, 64), (300_000,), (5,), (200_000, 2)]  # 2.8 MB: chunk 1
    tensors = [arena.empty(shape, torch.float32) for shape in shapes]
    tensors.append(arena.empty((400_000,), torch.float32))  # 1.6 MB more: spills to chunk 2
    tensors.append(arena.empty((3 << 20,), torch.float32))  # 12 MB > half a chunk: its own
    assert len(advice) == 3
    chunk1, chunk2, own = advice
    assert all(_inside(t, chunk1) for t in tensors[:6])
    assert _inside(tensors[6], chunk2) and tensors[6].data_ptr() == chunk2[0]
    assert _inside(tensors[7], own) and own[1] == 12 << 20
    for i, t in enumerate(tensors):
        assert t.is_contiguous() and t.data_ptr() % 64 == 0
        t.fill_(float(i))
    del arena
    gc.collect()
    for i, t in enumerate(tensors):  # nothing overwrote anything, nothing was unmapped
        assert bool((t == float(i)).all())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


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


def test_cpu_kv_pool_is_zero_filled_even_from_dirty_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        layout, "empty_huge", lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype)
    )
    pool = allocate_kv_pool(2, 64, 16, 2, 64, torch.float32, "cpu")
    assert pool.shape == (2, 2, 64, 16, 2, 64) and pool.is_contiguous()
    assert int(torch.count_nonzero(pool)) == 0


def test_cpu_kv_pool_is_advised(advice: list[tuple[int, int]]) -> None:
    pool = allocate_kv_pool(2, 64, 16, 2, 64, torch.float32, "cpu")  # 2 MB
    assert len(advice) == 1 and _inside(pool, advice[0])


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    hm.huge_pages_mode() not in ("always", "madvise"), reason="no transparent huge pages here"
)
def test_the_kernel_records_the_advice() -> None:
    """The real madvise call: the mapping carries the kernel's huge-page flag ("hg")."""
    t = hm.empty_huge((1 << 20,), torch.float32)
    if hm._advice_failed:
        pytest.skip("this kernel refused MADV_HUGEPAGE")
    assert "hg" in _vm_flags(t.data_ptr())
    # the control: a fresh anonymous mapping, not advised. NOTE: not torch.empty: the
    # allocator may hand out memory from a region an earlier test advised (a CI run saw it)
    control = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(control, dtype=torch.uint8).data_ptr()
    assert "hg" not in _vm_flags(address)


def test_status_says_whether_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hm, "_advice_failed", False)
    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "never")
    assert hm.huge_pages_status() == "off (THP never)"
    monkeypatch.setattr(hm, "huge_pages_mode", lambda: "madvise")
    assert hm.huge_pages_status() == "on (THP madvise)"
    monkeypatch.setattr(hm, "_advice_failed", True)
    assert hm.huge_pages_status() == "off (madvise refused)"
