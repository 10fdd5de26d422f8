"""Triton flash-decoding reduce: merging per-split partials equals one softmax over everything."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.triton.decode_reduce import decode_reduce_triton  # noqa: E402
from tests.kernels.paged_case import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
def test_merge_equals_full_softmax(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    page_size, pages_per_split, num_splits, num_heads, head_dim = 16, 2, 5, 3, 24
    tokens_per_split = page_size * pages_per_split
    # decode seqs of 1, 2 and 5 valid splits; seq 1 is a prefill chunk (n_s = 2): skipped
    ctx_lens = [20, 33, 7, 160]
    new_lens = [1, 2, 1, 1]
    starts = [0, 1, 3, 4, 5]
    partial_out = torch.full((4, num_heads, num_splits, head_dim), float("nan"))
    partial_max = torch.full((4, num_heads, num_splits), float("nan"))
    partial_sum = torch.full((4, num_heads, num_splits), float("nan"))
    out = torch.full((5, num_heads, head_dim), -7.0)
    expected = out.clone()
    for s, ctx in enumerate(ctx_lens):
        scores = torch.randn(num_heads, ctx, generator=gen) * 3  # log2 domain
        values = torch.randn(ctx, head_dim, generator=gen)
        if new_lens[s] != 1:
            continue
        expected[starts[s]] = torch.softmax(scores * math.log(2), dim=-1) @ values
        for split in range(math.ceil(ctx / tokens_per_split)):
            part = slice(split * tokens_per_split, min((split + 1) * tokens_per_split, ctx))
            m = scores[:, part].max(dim=-1).values
            p = torch.exp2(scores[:, part] - m[:, None])
            partial_max[s, :, split] = m
            partial_sum[s, :, split] = p.sum(dim=-1)
            partial_out[s, :, split] = p @ values[part]
    out = out.to(device)
    decode_reduce_triton(
        partial_out.to(device),
        partial_max.to(device),
        partial_sum.to(device),
        torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        out,
        pages_per_split,
        page_size,
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_rejects_non_fp32_partials() -> None:
    partial = torch.zeros(1, 1, 2, 16, dtype=torch.float16)
    stats = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="partial_out must be a contiguous float32 tensor"):
        decode_reduce_triton(
            partial,
            stats,
            stats,
            torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, 1, 16),
            1,
            16,
        )
