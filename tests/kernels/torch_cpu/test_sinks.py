"""Attention sinks (gpt-oss) through the torch backend: full and sliding layers, prefill chunks
and decode rows, on the native CPU kernels (the sinks join each softmax inside them) and on
the torch path, against the naive oracle."""

from __future__ import annotations

import pytest
import torch

from prefixgate import kernels
from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.torch_cpu import windowed
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import TOLERANCES, PagedBatch, make_paged_batch

# a fresh prompt, a chunk after a cached prefix, decode rows inside and past the window
CTX, NEW = [40, 90, 5, 33, 70], [40, 9, 1, 1, 1]


def _step(batch: PagedBatch, window: int | None, sinks: torch.Tensor, native: bool
          ) -> torch.Tensor:
    pool = torch.stack([batch.k_cache, batch.v_cache])[None]  # [1, 2, P, page, Hkv, D]
    backend = kernels.create_backend("torch", pool, native=native)
    starts, tables = batch.query_start_loc.tolist(), batch.block_tables.tolist()
    page_size, slots = batch.k_cache.shape[1], []
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        slots += [tables[s][p // page_size] * page_size + p % page_size
                  for p in range(ctx - (starts[s + 1] - starts[s]), ctx)]
    slot_mapping = torch.tensor(slots)
    longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
    step = backend.prepare_metadata(kernels.AttentionInputs(
        tables, batch.seq_lens.tolist(), starts, longest, slot_mapping, batch.block_tables,
        batch.seq_lens, batch.query_start_loc))  # fmt: skip
    flat_k, flat_v = pool[0, 0].flatten(0, 1), pool[0, 1].flatten(0, 1)
    return step.forward(batch.query, flat_k[slot_mapping], flat_v[slot_mapping], pool[0, 0],
                        pool[0, 1], batch.scale, window=window, sinks=sinks)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_in_every_path_match_the_oracle(window, native, monkeypatch):
    if native and library() is None:
        pytest.skip("native CPU library not built here")
    batch = make_paged_batch(CTX, NEW, group_size=2, head_dim=64, seed=7)
    sinks = torch.randn(batch.query.shape[1]) * 2
    calls: list[str] = []
    for name in ("paged_decode_native", "paged_prefill_native"):
        real = getattr(windowed, name)
        monkeypatch.setattr(windowed, name,
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    out = _step(batch, window, sinks, native)
    expected = naive_paged_attention(batch, window, sinks)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    # the sinks matter: without them the output differs
    assert (expected - naive_paged_attention(batch, window)).abs().max() > 1e-2
    if native:
        assert calls.count("paged_prefill_native") == 2 and calls.count("paged_decode_native") == 1
