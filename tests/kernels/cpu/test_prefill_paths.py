"""Both paths of the native prefill kernel (kernels/cpu/csrc/paged_prefill.c): the AMX-BF16 tiles
(where the CPU has them; fp32 operands split into exact bf16 pieces; by default for bf16 pages
only, ``PREFIXGATE_PREFILL_AMX=all`` for fp32 pages too) and the AVX-512 FMA path
(``PREFIXGATE_PREFILL_AMX=0``, and every CPU without AMX). Each must match SDPA on the same
pages, keep a row's bits independent of chunking and thread count, and give bf16 pages the
bits of fp32 pages holding the same values. test_prefill.py runs the default selection."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.cpu.prefill import paged_prefill_native
from prefixgate.kernels.torch_cpu.attention import _prefill_one

pytestmark = pytest.mark.skipif(library() is None, reason="native CPU library not built here")


@pytest.fixture(params=["all", "0"], ids=["amx", "fma"])
def path(request, monkeypatch) -> str:
    monkeypatch.setenv("PREFIXGATE_PREFILL_AMX", request.param)
    return request.param


def _case(n: int, ctx: int, hq: int, hkv: int, d: int, page_size: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    used = -(-ctx // page_size)
    k_cache = torch.randn(used + 5, page_size, hkv, d, generator=gen)
    v_cache = torch.randn(used + 5, page_size, hkv, d, generator=gen)
    pages = torch.randperm(used + 5, generator=gen)[:used]
    return torch.randn(n, hq, d, generator=gen), k_cache, v_cache, pages


@pytest.mark.parametrize(
    ("n", "ctx", "hq", "hkv", "d"),
    [
        (37, 37, 9, 3, 64),  # SmolLM2's heads, a fresh prompt (one partial tile of rows)
        (150, 150, 9, 3, 64),  # more than one 64-position item
        (16, 1300, 9, 3, 64),  # a short chunk deep in a context: spans as items of their own
        (300, 1100, 9, 3, 64),  # spans merged as they go
        (33, 33, 4, 4, 128),  # head dim 128 (the output in two passes of 4 tiles)
        (20, 45, 8, 2, 32),  # head dim 32: one K chunk
        (64, 100, 6, 2, 48),  # head dim 48: not a multiple of 32, the FMA path either way
    ],
)
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_matches_sdpa(path: str, n: int, ctx: int, hq: int, hkv: int, d: int, kv: str) -> None:
    query, k_cache, v_cache, pages = _case(n, ctx, hq, hkv, d)
    if kv == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.full_like(query, float("nan"))
    assert paged_prefill_native(out, query, k_cache, v_cache, pages, ctx, d**-0.5)
    expected = _prefill_one(query, k_cache, v_cache, pages.int(), ctx, d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_bf16_pages_give_the_bits_of_the_same_values_in_fp32_pages(path: str) -> None:
    query, k_cache, v_cache, pages = _case(130, 700, 9, 3, 64, seed=1)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    out, widened = torch.empty_like(query), torch.empty_like(query)
    assert paged_prefill_native(out, query, k16, v16, pages, 700, 0.125)
    assert paged_prefill_native(widened, query, k16.float(), v16.float(), pages, 700, 0.125)
    assert torch.equal(out, widened)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_a_row_has_the_same_bits_however_chunked_and_threaded(path: str, kv: str) -> None:
    ctx = 900
    query, k_cache, v_cache, pages = _case(ctx, ctx, 9, 3, 64, seed=2)
    if kv == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    whole = torch.empty_like(query)
    assert paged_prefill_native(whole, query, k_cache, v_cache, pages, ctx, 0.125, 2)
    for tail, threads in ((200, 1), (40, 3), (3, 2)):
        part = torch.empty_like(query[-tail:])
        assert paged_prefill_native(part, query[-tail:], k_cache, v_cache, pages, ctx, 0.125,
                                    threads)
        assert torch.equal(part, whole[-tail:])


def _oracle(query, k_cache, v_cache, pages, ctx, scale, window, sinks):
    """fp64 softmax attention over the gathered context: row i at ctx - n + i sees
    (pos - window, pos]; a head's sink adds exp(sink) to its softmax's denominator."""
    n, hq, d = query.shape
    hkv = k_cache.shape[2]
    k = k_cache[pages].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(hq // hkv, 1)
    v = v_cache[pages].reshape(-1, hkv, d)[:ctx].double().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("nhd,khd->hnk", query.double(), k) * scale
    pos = torch.arange(ctx - n, ctx)[:, None]
    keys = torch.arange(ctx)[None, :]
    scores = scores.masked_fill(~((keys <= pos) & (keys > pos - window)), float("-inf"))
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks.double()[:, None, None])
    weights = (scores - top).exp()
    total = weights.sum(-1, keepdim=True) + (sinks.double()[:, None, None] - top).exp()
    return torch.einsum("hnk,khd->nhd", weights / total, v)


def test_a_window_and_sinks(path: str) -> None:
    """A sliding layer's rows and a gpt-oss sink per head, against an fp64 oracle."""
    query, k_cache, v_cache, pages = _case(70, 200, 8, 2, 64, seed=3)
    sinks = torch.randn(8)
    out = torch.empty_like(query)
    assert paged_prefill_native(out, query, k_cache, v_cache, pages, 200, 0.125, window=33,
                                sinks=sinks)
    expected = _oracle(query, k_cache, v_cache, pages, 200, 0.125, 33, sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_the_two_paths_agree(monkeypatch, kv: str) -> None:
    query, k_cache, v_cache, pages = _case(256, 2000, 9, 3, 64, seed=4)
    if kv == "bf16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    outs = []
    for flag in ("all", "0"):
        monkeypatch.setenv("PREFIXGATE_PREFILL_AMX", flag)
        out = torch.empty_like(query)
        assert paged_prefill_native(out, query, k_cache, v_cache, pages, 2000, 0.125)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
