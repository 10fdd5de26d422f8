"""kernels/torch_cpu/windowed.py through the torch backend with native kernels on: a sliding
layer's step (prefill chunks, decode rows of different lengths, a shared-prefix group) against
the naive oracle, on the native kernels and on their torch fallback."""

from __future__ import annotations

import pytest
import torch

from prefixgate import kernels
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.torch_cpu import windowed
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import (
    TOLERANCES,
    PagedBatch,
    make_paged_batch,
    make_shared_prefix_batch,
)

pytestmark = pytest.mark.skipif(library() is None, reason="native CPU library not built here")

# a fresh prompt, a chunk after a cached prefix, decode rows inside and past the window
CTX, NEW = [40, 90, 5, 33, 70], [40, 9, 1, 1, 1]


def _sliding_step(batch: PagedBatch, window: int) -> torch.Tensor:
    """One sliding layer of a step through a native torch backend (K/V of the new rows
    rewritten with what the pages hold, so the oracle sees the same pages)."""
    pool = torch.stack([batch.k_cache, batch.v_cache])[None]  # [1, 2, P, page, Hkv, D]
    backend = kernels.create_backend("torch", pool, native=True)
    starts, tables = batch.query_start_loc.tolist(), batch.block_tables.tolist()
    page_size, slots = batch.k_cache.shape[1], []
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        slots += [tables[s][p // page_size] * page_size + p % page_size
                  for p in range(ctx - (starts[s + 1] - starts[s]), ctx)]
    slot_mapping = torch.tensor(slots)
    longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
    step = backend.prepare_metadata(kernels.AttentionInputs(
        tables, batch.seq_lens.tolist(), starts, longest, slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
    ))
    flat_k, flat_v = pool[0, 0].flatten(0, 1), pool[0, 1].flatten(0, 1)
    return step.forward(batch.query, flat_k[slot_mapping], flat_v[slot_mapping], pool[0, 0],
                        pool[0, 1], batch.scale, window=window)


@pytest.mark.parametrize("window", [1, 6, 16, 50])
def test_a_sliding_step_runs_the_native_kernels_and_matches_the_oracle(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_paged_batch(CTX, NEW, group_size=3, head_dim=64, seed=window)
    calls: list[str] = []
    for name in ("paged_decode_native", "paged_prefill_native"):
        real = getattr(windowed, name)
        monkeypatch.setattr(windowed, name,
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    out = _sliding_step(batch, window)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch, window),
                               **TOLERANCES[torch.float32])
    assert calls.count("paged_prefill_native") == 2 and calls.count("paged_decode_native") == 1


def test_rows_the_kernels_decline_take_the_torch_window(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_paged_batch(CTX, NEW, group_size=3, head_dim=64, seed=3)
    monkeypatch.setattr(windowed, "paged_decode_native", lambda *a, **k: False)
    monkeypatch.setattr(windowed, "paged_prefill_native", lambda *a, **k: False)
    out = _sliding_step(batch, 6)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch, 6),
                               **TOLERANCES[torch.float32])


@pytest.mark.parametrize("window", [8, 700])
def test_a_shared_prefix_group_attends_each_row_own_window(window: int) -> None:
    # four decode rows sharing 40 pages: a full layer would take the cascade path
    batch = make_shared_prefix_batch(40, [5, 16, 1, 23], group_size=3, seed=window)
    out = _sliding_step(batch, window)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch, window),
                               **TOLERANCES[torch.float32])
