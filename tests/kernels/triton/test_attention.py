"""Triton paged attention (decode + prefill kernels together) on mixed flat batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.torch_cpu.attention import paged_attention_torch, write_kv_torch  # noqa: E402
from prefixgate.kernels.triton.attention import paged_attention_triton  # noqa: E402
from prefixgate.kernels.triton.write_kv import write_kv_triton  # noqa: E402
from tests.kernels.oracle import naive_paged_attention  # noqa: E402
from tests.kernels.paged_case import (  # noqa: E402
    DEVICES,
    TOLERANCES,
    make_paged_batch,
)

# decode of a fully cached prefix, a chunk after a partly cached prefix, decode off a page
# boundary, a prefill from scratch, a 1-token context, a chunk of 33 after 31 cached tokens
MIXED = ([37, 50, 100, 16, 1, 64], [1, 7, 1, 16, 1, 33])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("page_size", [16, 32])
def test_mixed_batch_never_reads_outside_the_context(
    device: str, group_size: int, page_size: int
) -> None:
    """NaN in every slot outside the contexts (and junk past the block tables) stays out."""
    batch = make_paged_batch(
        *MIXED,
        group_size=group_size,
        page_size=page_size,
        device=device,
        seed=group_size,
        garbage=float("nan"),
    )
    out = paged_attention_triton(*batch.args(), pages_per_split=2)
    torch.testing.assert_close(
        out.cpu().double(), naive_paged_attention(batch), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_reference(device: str, dtype: torch.dtype) -> None:
    batch = make_paged_batch(*MIXED, group_size=4, head_dim=64, dtype=dtype, device=device, seed=3)
    out = paged_attention_triton(*batch.args(), max_query_len=33)
    expected = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_pages_under_an_fp32_query(device: str) -> None:
    """``--kv-dtype bf16`` under an fp32 model: bf16 pages, fp32 query and output. The kernels
    cast the query to the compute dtype (bf16 tiles on GPU, fp32 under the interpreter) and
    accumulate in fp32; the torch reference widens the pages to fp32."""
    batch = make_paged_batch(*MIXED, group_size=3, head_dim=64, device=device, seed=5)
    batch = dataclasses.replace(
        batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16()
    )
    out = paged_attention_triton(*batch.args(), max_query_len=33)
    expected = paged_attention_torch(*batch.args())
    assert out.dtype == expected.dtype == torch.float32
    tolerance = TOLERANCES[torch.bfloat16 if device == "cuda" else torch.float32]
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_only_hint_skips_prefill(device: str) -> None:
    batch = make_paged_batch([37, 50, 100], [1, 1, 1], group_size=2, device=device, seed=4)
    out = paged_attention_triton(*batch.args(), max_query_len=1)
    torch.testing.assert_close(out, paged_attention_torch(*batch.args()), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_write_then_attend_like_a_model_step(device: str) -> None:
    """One step: write the new tokens' K/V into their slots, then attend (Triton vs torch)."""
    ctx_lens, new_lens, page_size = [45, 20, 33], [1, 12, 33], 16
    batch = make_paged_batch(
        ctx_lens, new_lens, group_size=3, page_size=page_size, device=device, seed=9
    )
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(sum(new_lens), *batch.k_cache.shape[2:], generator=gen).to(device)
    value = torch.randn(sum(new_lens), *batch.k_cache.shape[2:], generator=gen).to(device)
    tables = batch.block_tables.cpu().tolist()
    slots = [
        tables[s][p // page_size] * page_size + p % page_size
        for s, (ctx, n) in enumerate(zip(ctx_lens, new_lens, strict=True))
        for p in range(ctx - n, ctx)
    ]
    slot_mapping = torch.tensor(slots, device=device)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_torch(key, value, k_ref, v_ref, slot_mapping)
    write_kv_triton(key, value, batch.k_cache, batch.v_cache, slot_mapping)
    expected = paged_attention_torch(batch.query, k_ref, v_ref, *batch.args()[3:])
    out = paged_attention_triton(*batch.args())
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device: str) -> None:
    batch = make_paged_batch([5], [1], device=device)
    query = batch.query[:0]
    starts = torch.zeros(2, dtype=torch.int32, device=device)
    out = paged_attention_triton(
        query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, starts, batch.scale
    )
    assert out.shape == (0, *batch.query.shape[1:])


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_tiny_head_dim(device: str) -> None:
    batch = make_paged_batch([5], [1], head_dim=8, device=device)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        paged_attention_triton(*batch.args())


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_int64_block_tables(device: str) -> None:
    batch = make_paged_batch([5], [1], device=device)
    with pytest.raises(ValueError, match="block_tables must be torch.int32"):
        paged_attention_triton(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables.long(),
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
        )


@pytest.mark.parametrize("device", DEVICES)
def test_query_sliced_from_fused_qk(device: str) -> None:
    """The model passes q as a strided view of a fused [T, Hq + Hkv, D] tensor."""
    batch = make_paged_batch(*MIXED, group_size=3, device=device, seed=12)
    num_tokens, num_q_heads, head_dim = batch.query.shape
    fused = torch.randn(num_tokens, num_q_heads + 2, head_dim, device=device)
    fused[:, :num_q_heads] = batch.query
    query = fused[:, :num_q_heads]
    assert not query.is_contiguous()
    expected = naive_paged_attention(batch)
    for out in (
        paged_attention_triton(query, *batch.args()[1:]),
        paged_attention_torch(query, *batch.args()[1:]),
    ):
        assert out.is_contiguous()
        torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "pages_per_split"), [(1, None), (5, 1), (20, 1), (40, 2),
                                                         (1000, 1)])
def test_sliding_window_never_reads_outside_it(device: str, window: int,
                                               pages_per_split: int | None) -> None:
    """A sliding layer: each row sees its last ``window`` positions only; NaN everywhere outside
    the contexts, and split-K splits wholly before the window skipped by decode and reduce."""
    batch = make_paged_batch(*MIXED, group_size=3, device=device, seed=window,
                             garbage=float("nan"))
    out = paged_attention_triton(*batch.args(), pages_per_split=pages_per_split, window=window)
    torch.testing.assert_close(
        out.cpu().double(), naive_paged_attention(batch, window), atol=2e-5, rtol=1e-5
    )
