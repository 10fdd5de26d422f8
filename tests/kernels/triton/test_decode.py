"""Triton split-K paged decode kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.checks import check_attention_inputs  # noqa: E402
from prefixgate.kernels.torch_cpu.attention import paged_attention_torch  # noqa: E402
from prefixgate.kernels.triton.decode import (  # noqa: E402
    MAX_SPLITS,
    paged_decode_triton,
    plan_decode_splits,
)
from tests.kernels.paged_case import (  # noqa: E402
    DEVICES,
    TOLERANCES,
    PagedBatch,
    make_paged_batch,
)

# fully cached prefixes, lengths off page boundaries, a 1-token context, one long sequence
DECODE_CTX = [37, 50, 1, 129, 16, 200]


def run_decode(batch: PagedBatch, pages_per_split: int | None):
    out = torch.full_like(batch.query, float("nan"))
    shapes = check_attention_inputs(*batch.args()[:-1])
    plan = paged_decode_triton(*batch.args(), out, shapes, pages_per_split=pages_per_split)
    return out, plan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("pages_per_split", [None, 1, 3])
def test_matches_reference(
    device: str, group_size: int, page_size: int, pages_per_split: int | None
) -> None:
    batch = make_paged_batch(
        DECODE_CTX,
        [1] * len(DECODE_CTX),
        group_size=group_size,
        page_size=page_size,
        device=device,
        seed=group_size,
    )
    out, plan = run_decode(batch, pages_per_split)
    if pages_per_split is not None:  # split-K + reduce kernel exercised
        assert plan.pages_per_split == pages_per_split
        assert plan.num_splits == -(-batch.block_tables.shape[1] // pages_per_split) > 1
    torch.testing.assert_close(out, paged_attention_torch(*batch.args()), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device: str, dtype: torch.dtype) -> None:
    batch = make_paged_batch(
        DECODE_CTX,
        [1] * len(DECODE_CTX),
        group_size=4,
        page_size=16,
        head_dim=64,
        dtype=dtype,
        device=device,
        seed=11,
    )
    out, _ = run_decode(batch, pages_per_split=2)
    assert out.dtype == dtype
    expected = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_leaves_prefill_rows_alone(device: str) -> None:
    """In a mixed batch the decode kernel writes exactly the decode sequences' rows."""
    batch = make_paged_batch([40, 30, 65], [1, 5, 1], group_size=2, device=device)
    out, _ = run_decode(batch, pages_per_split=1)
    expected = paged_attention_torch(*batch.args())
    decode_rows = [0, 6]
    torch.testing.assert_close(out[decode_rows], expected[decode_rows], **TOLERANCES[torch.float32])
    assert out[1:6].isnan().all()


def test_plan_splits_the_benchmark_shape() -> None:
    """Batch 64 x 8 KV heads x 4096 tokens on 132 SMs: split, whole loop iterations per split."""
    plan = plan_decode_splits(64, 8, max_pages=256, page_size=16, num_sms=132)
    assert plan.num_splits > 1
    assert plan.pages_per_split % 4 == 0  # 64-token iterations of 16-token pages
    assert plan.num_splits * plan.pages_per_split >= 256
    assert (plan.num_splits - 1) * plan.pages_per_split < 256  # no empty trailing split


def test_plan_small_batch_long_context_uses_many_splits() -> None:
    plan = plan_decode_splits(1, 1, max_pages=8192, page_size=16, num_sms=132)
    assert plan.num_splits == MAX_SPLITS


def test_plan_short_contexts_do_not_split() -> None:
    assert plan_decode_splits(2, 2, max_pages=8, page_size=16, num_sms=132).num_splits == 1


def test_plan_rejects_bad_forced_split() -> None:
    with pytest.raises(ValueError, match="pages_per_split must be >= 1"):
        plan_decode_splits(2, 2, max_pages=8, page_size=16, num_sms=132, pages_per_split=0)
