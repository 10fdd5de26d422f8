"""Triton copy-on-write page copy against the torch reference, across every layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.torch_cpu.attention import copy_pages_torch  # noqa: E402
from prefixgate.kernels.triton.copy_pages import copy_pages_triton  # noqa: E402
from tests.kernels.paged_case import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_all_layers(device: str, dtype: torch.dtype) -> None:
    # page of 32 * 3 * 48 = 4608 elements: more than one COPY_BLOCK chunk, ragged tail
    pool = torch.randn(4, 2, 7, 32, 3, 48).to(device=device, dtype=dtype)
    src = torch.tensor([0, 3, 3], device=device)  # one page forked twice
    dst = torch.tensor([6, 1, 2], device=device)
    expected = pool.clone()
    copy_pages_torch(expected, src, dst)
    before = pool.clone()
    copy_pages_triton(pool, src, dst)
    assert torch.equal(pool, expected)
    for s, d in ((0, 6), (3, 1), (3, 2)):
        assert torch.equal(pool[:, :, d], before[:, :, s])  # every layer, K and V
    untouched = [0, 3, 4, 5]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_no_pairs_is_a_no_op(device: str) -> None:
    pool = torch.randn(2, 2, 3, 16, 1, 16, device=device)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    copy_pages_triton(pool, empty, empty)
    assert torch.equal(pool, before)


def test_rejects_mismatched_pairs() -> None:
    pool = torch.zeros(1, 2, 3, 16, 1, 16)
    with pytest.raises(ValueError, match="src has 2 page ids but dst has 1"):
        copy_pages_triton(pool, torch.tensor([0, 1]), torch.tensor([2]))
