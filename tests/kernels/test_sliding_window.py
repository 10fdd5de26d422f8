"""kernels/sliding_window.py against a dense masked softmax over the unpaged K/V."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.sliding_window import paged_attention_windowed

PAGE_SIZE = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _dense(q, k, v, positions, window, scale):  # q [N, Hq, D]; k, v [L, Hkv, D]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = (k_pos <= positions[:, None]) & (positions[:, None] - k_pos < window)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


@pytest.mark.parametrize("window", [1, 3, 4, 9, 100])
def test_windowed_attention_matches_dense_over_scattered_pages(window):
    torch.manual_seed(0)
    # two sequences: a 13-token prefill chunk after 6 cached tokens, and a 1-token decode at 21
    lens, new = [19, 22], [13, 1]
    num_pages = 16
    k_cache = torch.randn(num_pages, PAGE_SIZE, KV_HEADS, DIM)
    v_cache = torch.randn(num_pages, PAGE_SIZE, KV_HEADS, DIM)
    tables = [[9, 2, 14, 5, 0], [3, 11, 7, 1, 12, 6]]  # scattered, not in order
    block_tables = torch.tensor([t + [0] * (6 - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(sum(new), HEADS, DIM)
    starts = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    out = paged_attention_windowed(
        query, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), starts,
        0.3, window,
    )  # fmt: skip
    for seq, (length, rows) in enumerate(zip(lens, new, strict=True)):
        pages = torch.tensor(tables[seq])
        k = k_cache[pages].reshape(-1, KV_HEADS, DIM)[:length]
        v = v_cache[pages].reshape(-1, KV_HEADS, DIM)[:length]
        q = query[starts[seq] : starts[seq + 1]]
        expected = _dense(q, k, v, torch.arange(length - rows, length), window, 0.3)
        torch.testing.assert_close(out[starts[seq] : starts[seq + 1]], expected)


def test_pages_outside_the_window_are_not_read():
    # a decode row at position 11 with window 4 sees positions 8..11: page 2 only
    k_cache = torch.full((4, PAGE_SIZE, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full((4, PAGE_SIZE, KV_HEADS, DIM), float("nan"))
    k_cache[3], v_cache[3] = 1.0, 2.0
    out = paged_attention_windowed(
        torch.ones(1, HEADS, DIM), k_cache, v_cache, torch.tensor([[0, 1, 3]], dtype=torch.int32),
        torch.tensor([12], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.1, 4,
    )  # fmt: skip
    assert torch.equal(out, torch.full_like(out, 2.0))
