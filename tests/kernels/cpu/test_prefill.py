"""The native CPU prefill attention kernel (kernels/cpu/prefill.py) against SDPA on the same
pages (kernels/torch_cpu/attention.py's torch path): shuffled pages, contexts off the page grid, GQA
1/3/8, page sizes 16/32, fresh prompts and suffixes after a cached prefix; bad input."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.prefill import paged_prefill_native
from prefixgate.kernels.torch_cpu.attention import _prefill_one
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import make_paged_batch, poison_before

pytestmark = pytest.mark.skipif(library() is None, reason="native CPU library not built here")


def _case(n: int, ctx: int, hq: int, hkv: int, d: int, page_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    used = -(-ctx // page_size)
    pool = used + 7
    k_cache = torch.randn(pool, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(pool, page_size, hkv, d, generator=gen)
    pages = torch.randperm(pool, generator=gen)[:used]  # scattered, in no order
    query = torch.randn(n, hq, d, generator=gen)
    return query, k_cache, v_cache, pages


@pytest.mark.parametrize(
    ("n", "ctx", "hq", "hkv", "d", "page_size"),
    [
        (1, 1, 3, 1, 64, 16),  # one token
        (37, 37, 9, 3, 64, 16),  # a fresh prompt off the page grid, SmolLM2's heads
        (70, 70, 8, 1, 64, 32),  # GQA 8, page 32, more than one row block
        (33, 33, 4, 4, 128, 16),  # GQA 1, head dim 128
        (5, 203, 9, 3, 64, 16),  # a short suffix after a cached prefix
        (64, 100, 6, 2, 48, 32),  # a chunk after earlier chunks; a generic head dim
        (1, 150, 8, 2, 32, 16),  # the whole prefix cached, one new token
        # every (group, head dim) the kernel specialises
        (20, 30, 2, 2, 64, 16),  # G 1, D 64
        (20, 30, 8, 2, 64, 16),  # G 4, D 64
        (20, 30, 8, 2, 128, 16),  # G 4, D 128
        (20, 30, 16, 2, 128, 16),  # G 8, D 128
        # key blocks of 16 that straddle pages
        (19, 45, 9, 3, 64, 8),
        (19, 45, 9, 3, 64, 12),
        (7, 23, 4, 2, 16, 1),
    ],
)
def test_matches_sdpa_on_scattered_pages(
    n: int, ctx: int, hq: int, hkv: int, d: int, page_size: int
) -> None:
    query, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d, page_size)
    out = torch.full_like(query, float("nan"))
    assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, d**-0.5)
    expected = _prefill_one(query, k_cache, v_cache, pages.int(), ctx, d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("query_scale", [60.0, -60.0])
def test_extreme_scores(query_scale: float) -> None:
    """Scores in the hundreds either way: the running max must track them exactly."""
    query, k_cache, v_cache, pages = _case(40, 90, 9, 3, 64, 16, seed=2)
    query = query * query_scale
    k_cache[pages] = k_cache[pages].abs() + 1  # all keys positive: every score one sign
    out = torch.empty_like(query)
    assert paged_prefill_native(out, query, k_cache, v_cache, pages, 90, 0.125)
    expected = _prefill_one(query, k_cache, v_cache, pages.int(), 90, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_a_nan_score_propagates_like_sdpa() -> None:
    query, k_cache, v_cache, pages = _case(6, 20, 4, 2, 64, 16, seed=3)
    k_cache[pages[0], 3, 1] = float("nan")  # token 3, KV head 1: seen by every row
    out = torch.empty_like(query)
    assert paged_prefill_native(out, query, k_cache, v_cache, pages, 20, 0.125)
    assert torch.isnan(out[:, 2:]).all()  # query heads 2, 3 read KV head 1
    assert not torch.isnan(out[:, :2]).any()


def test_strided_query_rows_and_thread_counts() -> None:
    """q sliced out of a fused qkv row; every thread count gives the same bits."""
    n, ctx, hq, hkv, d = 45, 60, 9, 3, 64
    _, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d, 16, seed=1)
    qkv = torch.randn(n, (hq + 2 * hkv) * d)
    query = qkv[:, : hq * d].view(n, hq, d)  # rows at stride (hq + 2 hkv) d
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(n, hq, d)
        assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, 0.125, threads)
        outs.append(out)
    expected = _prefill_one(query, k_cache, v_cache, pages.int(), ctx, 0.125)
    torch.testing.assert_close(outs[0], expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(("n", "ctx"), [(16, 1300), (70, 1100), (300, 1100)])
def test_spans_are_split_or_merged_in_place_with_the_same_bits(n: int, ctx: int) -> None:
    """Contexts past one span (512 keys): a short chunk deep in a context (few work items, so
    its spans run as items of their own and merge after) and a long one (items merge their
    spans as they go) match SDPA, and every thread count (which picks the path) gives the
    same bits."""
    query, k_cache, v_cache, pages = _case(n, ctx, 9, 3, 64, 16, seed=4)
    outs = []
    for threads in (1, 2, 3):
        out = torch.full_like(query, float("nan"))
        assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, 0.125, threads)
        outs.append(out)
    expected = _prefill_one(query, k_cache, v_cache, pages.int(), ctx, 0.125)
    torch.testing.assert_close(outs[0], expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_row_has_the_same_bits_however_the_prompt_was_chunked() -> None:
    """A row's arithmetic depends on its position and keys only: the last 40 rows of a
    700-token prompt prefilled whole equal the same rows run as a 40-row chunk, and as a
    3-row chunk, after the rest is cached."""
    ctx = 700
    query, k_cache, v_cache, pages = _case(ctx, ctx, 9, 3, 64, 16, seed=5)
    whole = torch.empty_like(query)
    assert paged_prefill_native(whole, query, k_cache, v_cache, pages, ctx, 0.125)
    for tail in (40, 3):
        part = torch.empty_like(query[-tail:])
        assert paged_prefill_native(part, query[-tail:], k_cache, v_cache, pages, ctx, 0.125)
        assert torch.equal(part, whole[-tail:])


def test_bad_addressing_raises_and_writes_nothing() -> None:
    query, k_cache, v_cache, pages = _case(8, 40, 4, 2, 64, 16)
    out = torch.zeros_like(query)
    with pytest.raises(ValueError, match="context 7 shorter than its 8 new rows"):
        paged_prefill_native(out, query, k_cache, v_cache, pages, 7, 0.125)
    with pytest.raises(ValueError, match="2 pages of 16 cannot hold 40 tokens"):
        paged_prefill_native(out, query, k_cache, v_cache, pages[:2], 40, 0.125)
    bad = pages.clone()
    bad[1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        paged_prefill_native(out, query, k_cache, v_cache, bad, 40, 0.125)
    bad[1] = -1
    with pytest.raises(ValueError, match="outside the pool"):
        paged_prefill_native(out, query, k_cache, v_cache, bad, 40, 0.125)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        paged_prefill_native(out[:, :3], query[:, :3], k_cache, v_cache, pages, 40, 0.125)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        paged_prefill_native(out[0], query[0], k_cache, v_cache, pages, 40, 0.125)
    assert int(torch.count_nonzero(out)) == 0


def test_declines_what_it_does_not_take() -> None:
    query, k_cache, v_cache, pages = _case(8, 40, 4, 2, 64, 16)
    out = torch.zeros_like(query)
    args = (pages, 40, 0.125)
    assert not paged_prefill_native(out.double(), query.double(), k_cache.double(),
                                    v_cache.double(), *args)
    q24, k24, v24, p24 = _case(8, 40, 4, 2, 24, 16)  # head dim not a multiple of 16
    assert not paged_prefill_native(torch.zeros_like(q24), q24, k24, v24, p24, 40, 0.125)
    strided_cache = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
    assert not paged_prefill_native(out, query, strided_cache, v_cache, *args)
    assert not paged_prefill_native(out, query, k_cache, v_cache, pages.int(), 40, 0.125)
    assert not paged_prefill_native(out, query, k_cache, v_cache, pages.to("meta"), 40, 0.125)
    rows_share = torch.zeros(1, 4, 64).expand(8, 4, 64)  # every output row the same memory
    assert not paged_prefill_native(rows_share, query, k_cache, v_cache, *args)
    both = torch.zeros(9, 4, 64)
    assert not paged_prefill_native(both[1:], both[:8], k_cache, v_cache, *args)  # shifted
    q_big, k1, v1, p1 = _case(4, 20, 17, 1, 16, 16)  # GQA group 17 > 16
    assert not paged_prefill_native(torch.zeros_like(q_big), q_big, k1, v1, p1, 20, 0.25)
    assert not paged_prefill_native(out, query, k_cache.half(), v_cache.half(), *args)  # fp16 pages
    assert not paged_prefill_native(out, query, k_cache.bfloat16(), v_cache, *args)  # mixed
    assert int(torch.count_nonzero(out)) == 0


@pytest.mark.parametrize(
    ("n", "ctx", "hq", "hkv", "d", "page_size"),
    [
        (37, 37, 9, 3, 64, 16),  # SmolLM2's heads, a fresh prompt
        (5, 203, 9, 3, 64, 16),  # a suffix after a cached prefix
        (70, 70, 8, 1, 64, 32),  # GQA 8
        (33, 33, 4, 4, 128, 16),  # head dim 128
        (64, 100, 6, 2, 48, 32),  # a generic (group, head dim)
        (19, 45, 9, 3, 64, 12),  # key blocks straddling pages
    ],
)
def test_bf16_pages_match_sdpa_on_the_same_pages(
    n: int, ctx: int, hq: int, hkv: int, d: int, page_size: int, monkeypatch
) -> None:
    """bf16 pages (``--kv-dtype bf16``) under an fp32 query: taken exactly, so the kernel
    computes what it computes on those values in fp32 pages, bit for bit, on the same path
    (``PREFIXGATE_PREFILL_AMX=all``: by default bf16 pages go to AMX tiles where the CPU has
    them and fp32 pages to the FMA path; test_prefill_paths.py checks each), and what the torch
    path computes reading the same bf16 pages, within fp32 summation order."""
    monkeypatch.setenv("PREFIXGATE_PREFILL_AMX", "all")
    query, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d, page_size)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.full_like(query, float("nan"))
    assert paged_prefill_native(out, query, k16, v16, pages, ctx, d**-0.5)
    widened = torch.full_like(query, float("nan"))
    assert paged_prefill_native(widened, query, k16.float(), v16.float(), pages, ctx, d**-0.5)
    assert torch.equal(out, widened)
    expected = _prefill_one(query, k16, v16, pages.int(), ctx, d**-0.5)
    assert expected.dtype == torch.float32  # the torch path widens the narrower cache too
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("n", "ctx", "window", "page_size", "group_size", "head_dim"),
    [
        (37, 37, 8, 16, 3, 64),  # a fresh prompt longer than its window
        (5, 203, 16, 16, 3, 64),  # a suffix after a cached prefix the window does not reach
        (40, 100, 33, 12, 2, 64),  # a chunk after earlier chunks; key blocks straddle pages
        (70, 200, 64, 16, 4, 128),  # three row blocks, each starting at its own window
        (70, 70, 1, 32, 1, 64),  # each row sees itself only
        (20, 30, 100, 16, 3, 48),  # a window longer than the context: plain causal
    ],
)
def test_a_window_matches_the_oracle_and_reads_nothing_before(
    n: int, ctx: int, window: int, page_size: int, group_size: int, head_dim: int
) -> None:
    """A sliding layer's prefill: row i sees (pos - window, pos]; every position before the
    first row's window is NaN, so a read poisons the output."""
    batch = make_paged_batch([ctx], [n], group_size=group_size, head_dim=head_dim,
                             page_size=page_size, seed=window, garbage=float("nan"))
    expected = naive_paged_attention(batch, window)
    poison_before(batch, [ctx - n - window + 1])
    pages = batch.block_tables[0, : -(-ctx // page_size)].long()
    out = torch.full_like(batch.query, float("nan"))
    assert paged_prefill_native(out, batch.query, batch.k_cache, batch.v_cache, pages, ctx,
                                batch.scale, window=window)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="window must be positive"):
        paged_prefill_native(out, batch.query, batch.k_cache, batch.v_cache, pages, ctx,
                             batch.scale, window=-3)
