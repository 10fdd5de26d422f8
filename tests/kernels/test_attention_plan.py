"""The torch backend's per-step plan, and shared-prefix (cascade) decode against the naive oracle."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels import attention_plan
from prefixgate.kernels.attention_plan import plan_attention
from prefixgate.kernels.torch_cpu.attention import paged_attention_torch
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import (
    PagedBatch,
    make_paged_batch,
    make_shared_prefix_batch,
)

FP32_CPU = {"atol": 2e-6, "rtol": 1e-5}


def _plan(batch: PagedBatch):
    return plan_attention(
        batch.block_tables.tolist(),
        batch.seq_lens.tolist(),
        batch.query_start_loc.tolist(),
        page_size=batch.k_cache.shape[1],
        kv_row_elems=batch.k_cache.shape[2] * batch.k_cache.shape[3],
    )


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_shared_prefix_decode_matches_naive(contiguous: bool, group_size: int) -> None:
    # own lengths: ragged, one ending exactly on a page boundary, one with a single token
    batch = make_shared_prefix_batch(
        40, [5, 16, 1, 23, 40], contiguous=contiguous, group_size=group_size, seed=group_size
    )
    plan = _plan(batch)
    assert len(plan.shared) == 1 and not plan.padded  # the case exercises the cascade path
    group = plan.shared[0]
    assert group.shared_len == 40 * 16
    assert (group.shared_first_page is not None) == contiguous
    out = paged_attention_torch(*batch.args(), plan)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)
    # and the plan built inside the call gives the same
    torch.testing.assert_close(paged_attention_torch(*batch.args()), out, atol=0, rtol=0)


def test_shared_run_stops_before_each_members_last_page() -> None:
    # every member's context is exactly the shared pages plus one page of its own: the run may
    # not include a page any member writes this step
    batch = make_shared_prefix_batch(36, [16, 16, 16], seed=1)
    plan = _plan(batch)
    assert [g.shared_len for g in plan.shared] == [36 * 16]
    # a member whose context ends inside the shared pages caps the run (its last page is its own)
    tables = batch.block_tables.tolist()
    lens = batch.seq_lens.tolist()
    lens[0] = 20 * 16 + 3
    plan = plan_attention(tables, lens, list(range(4)), page_size=16, kv_row_elems=64)
    assert [g.shared_len for g in plan.shared] == [20 * 16]


def test_groups_split_by_first_page_and_small_runs_stay_padded() -> None:
    a = make_shared_prefix_batch(40, [3, 9], seed=2)
    tables = a.block_tables.tolist()
    lens = a.seq_lens.tolist()
    # a third sequence shares nothing (different first page) and two share too little
    tables += [[90, 91, 92, 93, 94], [95, 96, 97], [95, 96, 98]]
    lens += [70, 40, 40]
    plan = plan_attention(tables, lens, list(range(6)), page_size=16, kv_row_elems=64)
    assert [sorted(g.suffix.rows.tolist()) for g in plan.shared] == [[0, 1]]
    assert sorted(r for chunk in plan.padded for r in chunk.rows.tolist()) == [2, 3, 4]


def test_sharing_can_be_turned_off() -> None:
    batch = make_shared_prefix_batch(40, [5, 9, 3], seed=4)
    tables, lens = batch.block_tables.tolist(), batch.seq_lens.tolist()
    plan = plan_attention(
        tables, lens, [0, 1, 2, 3], page_size=16, kv_row_elems=64, share_prefixes=False
    )
    assert not plan.shared
    shared_out = paged_attention_torch(*batch.args())
    padded_out = paged_attention_torch(*batch.args(), plan)
    torch.testing.assert_close(shared_out, padded_out, atol=2e-6, rtol=1e-5)


def test_below_the_saving_threshold_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_shared_prefix_batch(4, [5, 9], seed=6)  # 1 * 64 shared tokens saved
    assert not _plan(batch).shared
    monkeypatch.setattr(attention_plan, "MIN_SHARED_SAVING_TOKENS", 64)
    assert len(_plan(batch).shared) == 1


def test_shared_prefix_in_a_mixed_step() -> None:
    """Shared decode rows next to a prefill chunk and an unrelated decode row, one call."""
    shared = make_shared_prefix_batch(40, [7, 30], group_size=2, seed=8)
    other = make_paged_batch([50, 33], [9, 1], group_size=2, seed=9)
    # one pool: the other batch's pages after the shared batch's
    offset = shared.k_cache.shape[0]
    k_cache = torch.cat([shared.k_cache, other.k_cache])
    v_cache = torch.cat([shared.v_cache, other.v_cache])
    width = max(shared.block_tables.shape[1], other.block_tables.shape[1])
    tables = torch.full((4, width), -1, dtype=torch.int32)
    tables[:2, : shared.block_tables.shape[1]] = shared.block_tables
    moved = torch.where(other.block_tables >= 0, other.block_tables + offset, -1)
    tables[2:, : other.block_tables.shape[1]] = moved
    batch = PagedBatch(
        query=torch.cat([shared.query, other.query]),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        seq_lens=torch.cat([shared.seq_lens, other.seq_lens]),
        query_start_loc=torch.tensor([0, 1, 2, 11, 12], dtype=torch.int32),
        scale=shared.scale,
    )
    plan = _plan(batch)
    assert len(plan.shared) == 1 and plan.prefill == [2] and len(plan.padded) == 1
    out = paged_attention_torch(*batch.args(), plan)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


def test_shared_prefix_bf16_cache() -> None:
    batch = make_shared_prefix_batch(40, [5, 12, 30], group_size=3, dtype=torch.bfloat16, seed=10)
    assert len(_plan(batch).shared) == 1
    out = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), atol=3e-2, rtol=2e-2)


def test_plan_rejects_inconsistent_metadata() -> None:
    with pytest.raises(ValueError, match="S \\+ 1"):
        plan_attention([[0]], [3], [0], page_size=16, kv_row_elems=4)
    with pytest.raises(ValueError, match="rows <= seq_lens"):
        plan_attention([[0]], [3], [0, 5], page_size=16, kv_row_elems=4)
    with pytest.raises(ValueError, match="block table has 1 pages"):
        plan_attention([[0]], [40], [0, 1], page_size=16, kv_row_elems=4)


def test_a_stray_sequence_does_not_cut_the_groups_run() -> None:
    # 16 agents share 125 pages; a 17th shares only the first page with them
    shared = list(range(1000, 1125))
    tables = [shared + [2000 + 2 * i, 2001 + 2 * i] for i in range(16)]
    tables.append([1000, 5000, 5001, 5002])
    lens = [125 * 16 + 20] * 16 + [60]
    plan = plan_attention(tables, lens, list(range(18)), page_size=16, kv_row_elems=64)
    assert [(sorted(g.suffix.rows.tolist()), g.shared_len) for g in plan.shared] == [
        (list(range(16)), 125 * 16)
    ]
    assert [chunk.rows.tolist() for chunk in plan.padded] == [[16]]


def test_nested_sharing_picks_the_larger_saving() -> None:
    # four sequences share 40 pages; two pairs of them share 60 more each: two pair groups
    # (1 x 100 pages saved each) beat one group of four (3 x 40 pages)
    base = list(range(40))
    pair_a, pair_b = list(range(100, 160)), list(range(200, 260))
    tables = [
        base + pair_a + [300],
        base + pair_a + [301],
        base + pair_b + [302],
        base + pair_b + [303],
    ]
    lens = [101 * 16 - 3] * 4
    plan = plan_attention(tables, lens, list(range(5)), page_size=16, kv_row_elems=64)
    groups = sorted((sorted(g.suffix.rows.tolist()), g.shared_len) for g in plan.shared)
    assert groups == [([0, 1], 100 * 16), ([2, 3], 100 * 16)]
    assert not plan.padded


def test_a_large_group_is_split_by_the_gather_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_shared_prefix_batch(40, [5, 16, 1, 23, 40, 9], group_size=2, seed=11)
    whole = paged_attention_torch(*batch.args())
    per_token = batch.k_cache.shape[2] * batch.k_cache.shape[3]
    monkeypatch.setattr(attention_plan, "DECODE_GATHER_BUDGET", 2 * 40 * per_token)
    plan = _plan(batch)
    assert len(plan.shared) == 2  # one shared run, members in two budget-sized parts
    assert sorted(r for g in plan.shared for r in g.suffix.rows.tolist()) == list(range(6))
    assert all(g.shared_len == 40 * 16 for g in plan.shared)
    out = paged_attention_torch(*batch.args(), plan)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


@pytest.mark.parametrize("shape", ["identical", "chain"])
def test_thousands_of_sequences_on_one_prompt(shape: str) -> None:
    """No recursion limit and linear work: 3,000 decode rows sharing a long prompt."""
    count, shared = 3000, list(range(64))
    if shape == "identical":
        tables = [shared + [10_000 + i] for i in range(count)]
    else:  # each conversation branches one page later than the one before
        tables = [shared + list(range(1000, 1000 + i % 50)) + [10_000 + i] for i in range(count)]
    lens = [len(t) * 16 - 3 for t in tables]
    plan = plan_attention(tables, lens, list(range(count + 1)), page_size=16, kv_row_elems=64)
    members = sorted(r for g in plan.shared for r in g.suffix.rows.tolist())
    padded = sorted(r for c in plan.padded for r in c.rows.tolist())
    assert sorted(members + padded) == list(range(count))  # each row exactly once
    assert min(g.shared_len for g in plan.shared) >= 64 * 16
