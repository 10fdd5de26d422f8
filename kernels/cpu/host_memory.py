"""CPU tensors backed by transparent huge pages (2 MB) where the kernel allows it.

Why: a CPU decode step streams every weight and the whole K/V context from DRAM, through
pages scattered over hundreds of MB. With 4 KB pages that is a TLB miss every 4 KB; with 2 MB
pages, almost none (the linears and the paged decode attention of a decode step both gained:
docs/benchmarks.md).

Linux only, and only when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``: the memory is a fresh anonymous ``mmap`` (never reused heap, whatever the malloc)
advised with ``madvise(MADV_HUGEPAGE)`` before it is first touched, so its page faults map
huge pages. Anywhere else, or once the advice has failed, the tensors are ordinary
allocations; nothing depends on the advice being taken. With THP ``defrag`` set to
``madvise`` the first touch may compact memory synchronously, so zeroing a multi-GB KV pool
can take longer at startup on a fragmented host (serving itself is unaffected).
"""

from __future__ import annotations

import functools
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_mode() -> str:
    """The kernel's THP mode (``always`` / ``madvise`` / ``never``), or ``unavailable``."""
    if not sys.platform.startswith("linux"):
        return "unavailable"
    try:
        with open(_THP_SETTING, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    # e.g. "always [madvise] never": the bracketed word is the active mode
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


_advice_failed = False  # set once madvise has failed: later requests skip the attempt


def huge_pages_status() -> str:
    """How large CPU tensors from this module are backed, for logs and stats: ``on (THP
    madvise)`` / ``on (THP always)``, or ``off (...)`` with the reason."""
    mode = huge_pages_mode()
    if mode not in ("always", "madvise"):
        return f"off (THP {mode})"
    return "off (madvise refused)" if _advice_failed else f"on (THP {mode})"


def _advise(region: mmap.mmap, offset: int, length: int) -> None:
    """madvise(MADV_HUGEPAGE) on ``length`` bytes of ``region`` from ``offset``."""
    region.madvise(mmap.MADV_HUGEPAGE, offset, length)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _advised_buffer(nbytes: int) -> tuple[torch.Tensor, int] | None:
    """A fresh, untouched byte buffer holding ``nbytes`` at a 2 MB-aligned offset, advised for
    huge pages; (buffer, offset), or None when huge pages are not to be had here."""
    global _advice_failed
    if _advice_failed or huge_pages_mode() not in ("always", "madvise"):
        return None
    span = _round_up(nbytes, HUGE_PAGE)
    try:
        region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # out of address space / memory: let the ordinary allocation report it
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = (-raw.data_ptr()) % HUGE_PAGE
    try:
        _advise(region, offset, span)
    except (AttributeError, OSError, ValueError) as exc:  # no MADV_HUGEPAGE, or refused
        _advice_failed = True
        logger.info("huge pages unavailable (%s); using ordinary allocations", exc)
        return None
    return raw, offset


def _view(
    raw: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on CPU, in huge pages where available (contiguous;
    its contents are undefined, as with ``torch.empty``)."""
    shape = tuple(int(d) for d in shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    advised = _advised_buffer(nbytes) if nbytes >= HUGE_PAGE else None
    if advised is None:
        return torch.empty(shape, dtype=dtype)
    return _view(*advised, shape, dtype)


class HugePageArena:
    """Carves many CPU tensors (e.g. a model's packed weights) out of a few huge-page chunks,
    so tensors smaller than a huge page, or not a multiple of one, still get huge pages
    without rounding each up to 2 MB.

    Tensors are 64-byte aligned and stay valid after the arena is dropped (each is a view of
    its chunk, which lives as long as any of them). Requests of more than half a chunk get a
    dedicated :func:`empty_huge`. Not thread-safe: one arena per model, filled while it loads.
    """

    ALIGN = 64

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = _round_up(chunk_bytes, HUGE_PAGE)
        self._chunk: torch.Tensor | None = None  # the current chunk's bytes (aligned view)
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor (see :func:`empty_huge`)."""
        shape = tuple(int(d) for d in shape)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.chunk_bytes // 2:
            return empty_huge(shape, dtype)
        start = _round_up(self._used, self.ALIGN)
        if self._chunk is None or start + nbytes > self._chunk.numel():
            advised = _advised_buffer(self.chunk_bytes)
            if advised is None:
                return torch.empty(shape, dtype=dtype)
            raw, offset = advised
            self._chunk = raw[offset : offset + self.chunk_bytes]
            start = 0
        self._used = start + nbytes
        return _view(self._chunk, start, shape, dtype)


__all__ = ["HUGE_PAGE", "HugePageArena", "empty_huge", "huge_pages_mode", "huge_pages_status"]
