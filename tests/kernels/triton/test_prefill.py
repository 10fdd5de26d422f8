"""Triton prefix-prefill kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.checks import check_attention_inputs  # noqa: E402
from prefixgate.kernels.torch_cpu.attention import paged_attention_torch  # noqa: E402
from prefixgate.kernels.triton import prefill as triton_prefill  # noqa: E402
from prefixgate.kernels.triton.prefill import paged_prefill_triton  # noqa: E402
from tests.kernels.paged_case import (  # noqa: E402
    DEVICES,
    TOLERANCES,
    PagedBatch,
    make_paged_batch,
)

# a chunk after a partly cached prefix (cached part ends mid-page), a prefill from scratch
# longer than one query tile at GQA 1 (64 rows), a 2-token chunk, a chunk starting on a page
# boundary; plus a decode sequence the prefill kernel must leave alone
PREFILL = ([57, 70, 9, 96, 40], [20, 70, 2, 32, 1])


def run_prefill(batch: PagedBatch) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    shapes = check_attention_inputs(*batch.args()[:-1])
    paged_prefill_triton(*batch.args(), out, shapes)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("page_size", [16, 32])
def test_matches_reference(device: str, group_size: int, page_size: int) -> None:
    batch = make_paged_batch(
        *PREFILL,
        group_size=group_size,
        page_size=page_size,
        device=device,
        seed=group_size + page_size,
    )
    out = run_prefill(batch)
    expected = paged_attention_torch(*batch.args())
    prefill_rows = slice(0, 124)  # the decode sequence's row is 124
    torch.testing.assert_close(
        out[prefill_rows], expected[prefill_rows], **TOLERANCES[torch.float32]
    )
    assert out[124].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_many_small_tiles(device: str, group_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """16-row tiles: every sequence spans several tiles, sought by the binary search."""
    monkeypatch.setattr(triton_prefill, "PREFILL_BLOCK_M_SHORT", 16)
    batch = make_paged_batch(*PREFILL, group_size=group_size, device=device, seed=group_size)
    out = run_prefill(batch)
    expected = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out[:124], expected[:124], **TOLERANCES[torch.float32])
    assert out[124].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_long_chunks_take_wide_tiles(device: str) -> None:
    """A long prompt after a cached prefix: 128-row tiles, several per sequence."""
    batch = make_paged_batch([300, 200], [260, 200], group_size=2, device=device, seed=4)
    out = run_prefill(batch)
    torch.testing.assert_close(out, paged_attention_torch(*batch.args()), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device: str, dtype: torch.dtype) -> None:
    batch = make_paged_batch(
        [57, 30], [20, 30], group_size=4, head_dim=64, dtype=dtype, device=device, seed=7
    )
    out = run_prefill(batch)
    expected = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_causal_within_the_chunk(device: str) -> None:
    """Changing a later new token's K/V must not change earlier rows' outputs."""
    batch = make_paged_batch([40], [10], group_size=2, device=device, seed=2)
    before = run_prefill(batch)
    page = int(batch.block_tables[0, 39 // 16])
    batch.k_cache[page, 39 % 16] += 5.0  # the last new token (position 39)
    batch.v_cache[page, 39 % 16] -= 5.0
    after = run_prefill(batch)
    torch.testing.assert_close(after[:9], before[:9], atol=0, rtol=0)
    assert not torch.allclose(after[9], before[9])
