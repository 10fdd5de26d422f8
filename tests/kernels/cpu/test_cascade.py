"""The native cascade decode kernel (kernels/cpu/csrc/paged_cascade.c) against the torch path."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from prefixgate.kernels.attention_plan import plan_attention
from prefixgate.kernels.cpu.cascade import cascade_decode_native
from prefixgate.kernels.cpu.decode import native_decode_available, paged_decode_native
from prefixgate.kernels.torch_cpu import attention as reference
from prefixgate.kernels.torch_cpu.attention import _sdpa_with_lse, paged_attention_torch
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import make_shared_prefix_batch

FP32_CPU = {"atol": 2e-6, "rtol": 1e-5}

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)


def _run_case(
    num_kv_heads, group_size, head_dim, page_size, n_pages, batch, contiguous, dtype, seed=0
):
    """A pool, a shared run of ``n_pages`` (consecutive ids or shuffled), query rows 2.. of a
    bigger query (so rows are not 0..B-1)."""
    gen = torch.Generator().manual_seed(seed)
    pool = n_pages + 7
    k_cache = torch.randn(pool, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    if contiguous:
        pages = torch.arange(3, 3 + n_pages)
    else:
        pages = torch.randperm(pool, generator=gen)[:n_pages]
    query = torch.randn(batch + 5, num_kv_heads * group_size, head_dim, generator=gen)
    rows = torch.randperm(batch + 5, generator=gen)[:batch]
    return k_cache, v_cache, pages, query, rows


def _torch_run(k_cache, v_cache, pages, shared_len, query, rows, scale):
    """The torch path of reference._decode_shared_prefix's shared half: [B, Hq, D], [B, Hq]."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    batch = rows.shape[0]
    k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:shared_len].transpose(0, 1)[None]
    v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:shared_len].transpose(0, 1)[None]
    q = query[rows].view(batch, num_kv_heads, -1, head_dim).transpose(0, 1)
    q = q.reshape(1, num_kv_heads, -1, head_dim)
    o, lse = _sdpa_with_lse(q, k.float(), v.float(), None, scale)
    o = o[0].view(num_kv_heads, batch, -1, head_dim).transpose(0, 1).reshape(query[rows].shape)
    return o, lse[0].view(num_kv_heads, batch, -1).transpose(0, 1).reshape(batch, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize(
    ("num_kv_heads", "group_size", "head_dim", "batch", "n_pages", "shared_len"),
    [
        (3, 3, 64, 16, 128, 2048),  # SmolLM2-135M's b16 step
        (3, 3, 64, 5, 1, 9),  # shorter than one key block
        (2, 1, 32, 1, 3, 48),  # one sequence, an odd number of pages
        (4, 2, 128, 3, 33, 521),  # run ends inside its last page
        (1, 8, 48, 7, 17, 272),  # a generic head dim
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2, 8])
def test_shared_run_matches_sdpa(
    dtype,
    contiguous,
    num_kv_heads,
    group_size,
    head_dim,
    batch,
    n_pages,
    shared_len,
    num_threads,
) -> None:
    k_cache, v_cache, pages, query, rows = _run_case(
        num_kv_heads, group_size, head_dim, 16, n_pages, batch, contiguous, dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, 7.0)
    lse = torch.empty(batch, query.shape[1])
    assert cascade_decode_native(
        out,
        query,
        k_cache,
        v_cache,
        rows,
        pages,
        shared_len,
        scale,
        lse=lse,
        num_threads=num_threads,
    )
    want_o, want_lse = _torch_run(k_cache, v_cache, pages, shared_len, query, rows, scale)
    torch.testing.assert_close(out[rows], want_o, **FP32_CPU)
    torch.testing.assert_close(lse, want_lse, **FP32_CPU)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all()  # only the members' rows are written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_merge_with_own_pages_matches_the_union(dtype, num_threads) -> None:
    """own result + own lse in, attention over run + own keys out (and its lse)."""
    k_cache, v_cache, pages, query, rows = _run_case(3, 3, 64, 16, 10, 6, False, dtype, seed=4)
    scale = 0.125
    run_pages, own_pages = pages[:7], pages[7:]  # "own" = the last 3 pages, 40 tokens of them
    own_o, own_lse = _torch_run(k_cache, v_cache, own_pages, 40, query, rows, scale)
    out = torch.zeros_like(query)
    out[rows] = own_o
    lse = torch.empty_like(own_lse)
    assert cascade_decode_native(
        out,
        query,
        k_cache,
        v_cache,
        rows,
        run_pages,
        112,
        scale,
        own_lse,
        lse,
        num_threads=num_threads,
    )
    union = torch.cat([run_pages, own_pages])
    want_o, want_lse = _torch_run(k_cache, v_cache, union, 112 + 40, query, rows, scale)
    torch.testing.assert_close(out[rows], want_o, **FP32_CPU)
    torch.testing.assert_close(lse, want_lse, **FP32_CPU)


def _plan(batch, **kwargs):
    return plan_attention(
        batch.block_tables.tolist(),
        batch.seq_lens.tolist(),
        batch.query_start_loc.tolist(),
        page_size=batch.k_cache.shape[1],
        kv_row_elems=batch.k_cache[0, 0].numel(),
        **kwargs,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
def test_reference_cascade_goes_native_and_matches_no_sharing(
    dtype, contiguous, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_shared_prefix_batch(
        41,
        [5, 16, 1, 23, 70],
        contiguous=contiguous,
        num_kv_heads=3,
        group_size=3,
        head_dim=64,
        seed=5,
    )
    batch = dataclasses.replace(
        batch, k_cache=batch.k_cache.to(dtype), v_cache=batch.v_cache.to(dtype)
    )
    shared_plan = _plan(batch)
    assert len(shared_plan.shared) == 1
    calls = []
    real = reference.cascade_decode_native
    monkeypatch.setattr(
        reference, "cascade_decode_native", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    native = paged_attention_torch(*batch.args(), plan=shared_plan)
    assert calls  # the cascade really ran natively
    torch_cascade = paged_attention_torch(*batch.args(), plan=_plan(batch, use_native=False))
    unshared = paged_attention_torch(*batch.args(), plan=_plan(batch, share_prefixes=False))
    torch.testing.assert_close(native, torch_cascade, **FP32_CPU)
    torch.testing.assert_close(native, unshared, **FP32_CPU)
    torch.testing.assert_close(native.double(), naive_paged_attention(batch), **FP32_CPU)


def test_a_declined_cascade_falls_back_to_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel has already written the own-pages rows; the torch path overwrites them."""
    batch = make_shared_prefix_batch(40, [3, 9, 17], num_kv_heads=3, group_size=3, head_dim=64)
    plan = _plan(batch)
    assert len(plan.shared) == 1
    monkeypatch.setattr(reference, "cascade_decode_native", lambda *a, **k: False)
    out = paged_attention_torch(*batch.args(), plan=plan)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


def test_bad_addressing_raises_before_writing() -> None:
    k_cache, v_cache, pages, query, rows = _run_case(3, 3, 64, 16, 5, 4, False, torch.float32)
    out = torch.zeros_like(query)
    args = (k_cache, v_cache)
    bad_page = pages.clone()
    bad_page[3] = k_cache.shape[0]
    with pytest.raises(ValueError, match="page id"):
        cascade_decode_native(out, query, *args, rows, bad_page, 80, 0.125)
    negative = pages.clone()
    negative[0] = -1
    with pytest.raises(ValueError, match="page id"):
        cascade_decode_native(out, query, *args, rows, negative, 80, 0.125)
    bad_row = rows.clone()
    bad_row[-1] = query.shape[0]
    with pytest.raises(ValueError, match="row"):
        cascade_decode_native(out, query, *args, bad_row, pages, 80, 0.125)
    with pytest.raises(ValueError, match="shared run"):
        cascade_decode_native(out, query, *args, rows, pages, 81, 0.125)  # past its pages
    with pytest.raises(ValueError, match="shared run"):
        cascade_decode_native(out, query, *args, rows, pages, 0, 0.125)
    with pytest.raises(ValueError, match="shapes"):
        cascade_decode_native(out, query, *args, rows, pages, 80, 0.125, torch.zeros(3, 9))
    assert out.abs().sum() == 0


def test_declines_what_it_does_not_handle() -> None:
    k_cache, v_cache, pages, query, rows = _run_case(3, 3, 64, 16, 5, 4, False, torch.float32)
    out = torch.zeros_like(query)
    run = (rows, pages, 80, 0.125)
    assert not cascade_decode_native(out, query.bfloat16(), k_cache, v_cache, *run)
    assert not cascade_decode_native(out, query, k_cache.half(), v_cache.half(), *run)
    assert not cascade_decode_native(out, query, k_cache, v_cache.bfloat16(), *run)  # mixed
    assert not cascade_decode_native(out, query, k_cache, v_cache, rows, pages.int(), 80, 0.125)
    assert not cascade_decode_native(out, query, k_cache, v_cache, rows.int(), pages, 80, 0.125)
    strided = query.transpose(1, 2).contiguous().transpose(1, 2)  # head dim not dense
    assert not cascade_decode_native(out, strided, k_cache, v_cache, *run)
    narrow = (k_cache[..., :40], v_cache[..., :40])  # head dim 40: not a multiple of 16
    assert not cascade_decode_native(
        torch.zeros(9, 9, 40), torch.randn(9, 9, 40), *(t.contiguous() for t in narrow), *run
    )
    assert not cascade_decode_native(
        out, query, k_cache, v_cache, *run, lse=torch.zeros(4, 9).double()
    )
    assert out.abs().sum() == 0  # nothing written when declined


def test_the_own_pages_kernel_feeds_the_merge() -> None:
    """The production pairing: paged_decode_native's out + lse are the merge's inputs."""
    assert native_decode_available()
    batch = make_shared_prefix_batch(40, [7, 30, 2], num_kv_heads=3, group_size=3, head_dim=64)
    plan = _plan(batch)
    group = plan.shared[0]
    out = torch.empty_like(batch.query)
    own_lse = torch.empty(3, 9)
    suffix = group.suffix
    assert paged_decode_native(
        out,
        batch.query,
        batch.k_cache,
        batch.v_cache,
        suffix.rows,
        suffix.pages,
        suffix.lengths,
        batch.scale,
        own_lse,
    )
    assert cascade_decode_native(
        out,
        batch.query,
        batch.k_cache,
        batch.v_cache,
        suffix.rows,
        group.shared_pages,
        group.shared_len,
        batch.scale,
        own_lse,
    )
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)
