"""Attention sinks (gpt-oss) in the Triton decode (one split and split-K with its reduce) and
prefill kernels, full and sliding, against the naive oracle (interpreted on CPU here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.triton.attention import paged_attention_triton  # noqa: E402
from tests.kernels.oracle import naive_paged_attention  # noqa: E402
from tests.kernels.paged_case import DEVICES, make_paged_batch  # noqa: E402

# decode rows (one long enough to split), a chunk after a cached prefix, a fresh prefill
CTX, NEW = [37, 100, 50, 16], [1, 1, 7, 16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("pages_per_split", [None, 2])
def test_sinks_match_the_oracle(device: str, window: int | None,
                                pages_per_split: int | None) -> None:
    batch = make_paged_batch(CTX, NEW, group_size=2, head_dim=32, device=device, seed=9)
    sinks = (torch.randn(batch.query.shape[1]) * 2).to(device)
    out = paged_attention_triton(*batch.args(), pages_per_split=pages_per_split, window=window,
                                 sinks=sinks)
    expected = naive_paged_attention(batch, window, sinks)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=1e-5)
    assert (expected - naive_paged_attention(batch, window)).abs().max() > 1e-2
