"""The torch reference (production CPU path) against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels import attention_plan
from prefixgate.kernels.torch_cpu import attention as reference
from prefixgate.kernels.torch_cpu.attention import (
    copy_pages_torch,
    paged_attention_torch,
    write_kv_torch,
)
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import (
    ALL_DEVICES,
    TOLERANCES,
    make_paged_batch,
)

# (context lengths after the step, new rows): decode of a fully cached prefix, a chunk after
# a partly cached prefix, a prefill from scratch, lengths off page boundaries, a lone token
MIXED = ([37, 50, 100, 16, 1, 64], [1, 7, 1, 16, 1, 33])


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("page_size", [16, 32])
def test_mixed_batch_matches_naive(device: str, group_size: int, page_size: int) -> None:
    batch = make_paged_batch(*MIXED, group_size=group_size, page_size=page_size, device=device)
    out = paged_attention_torch(*batch.args())
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    # fp32 roundoff only on CPU; CUDA SDPA kernels sum in another order
    tolerance = {"atol": 2e-6, "rtol": 1e-5} if device == "cpu" else TOLERANCES[torch.float32]
    torch.testing.assert_close(out.cpu().double(), naive_paged_attention(batch), **tolerance)


def test_decode_chunks_split_by_gather_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many decode sequences of very different lengths, forced into several gather chunks."""
    ctx_lens = [5, 130, 17, 64, 1, 99, 33, 250, 48, 16]
    batch = make_paged_batch(ctx_lens, [1] * len(ctx_lens), group_size=2, page_size=16, seed=3)
    whole = paged_attention_torch(*batch.args())
    per_token = batch.k_cache.shape[2] * batch.k_cache.shape[3]
    monkeypatch.setattr(attention_plan, "DECODE_GATHER_BUDGET", 2 * 130 * per_token)
    chunk_sizes: list[int] = []
    decode_padded = reference._decode_padded

    def spy(*args, **kwargs):
        chunk_sizes.append(args[4].rows.numel())  # the `chunk` argument
        return decode_padded(*args, **kwargs)

    monkeypatch.setattr(reference, "_decode_padded", spy)
    chunked = paged_attention_torch(*batch.args())
    assert len(chunk_sizes) > 2 and sum(chunk_sizes) == len(ctx_lens)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked.double(), naive_paged_attention(batch), atol=2e-6, rtol=1e-5)


def test_bf16_cache_close_to_naive() -> None:
    batch = make_paged_batch(*MIXED, group_size=4, page_size=16, dtype=torch.bfloat16, seed=5)
    out = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), atol=3e-2, rtol=2e-2)


def test_rows_beyond_context_rejected() -> None:
    batch = make_paged_batch([4, 8], [1, 1])
    bad_starts = torch.tensor([0, 6, 7], dtype=torch.int32)  # 6 new rows but context 4
    query = torch.randn(7, *batch.query.shape[1:])
    with pytest.raises(ValueError, match="sequence 0: 6 new query rows but context length 4"):
        paged_attention_torch(
            query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            bad_starts,
            batch.scale,
        )


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_write_kv_skips_negative_slots(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(4, 16, 2, 8, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 2, 8, generator=gen).to(device)
    value = torch.randn(5, 2, 8, generator=gen).to(device)
    slots = torch.tensor([17, -1, 0, 63, -1], device=device)
    write_kv_torch(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[1, 1], key[0])
    torch.testing.assert_close(v_cache[0, 0], value[2])
    torch.testing.assert_close(k_cache[3, 15], key[3])
    # exactly three slots were written, nothing for the skipped tokens
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 3
    assert int((v_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 3


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_copy_pages_copies_every_layer(device: str) -> None:
    pool = torch.randn(3, 2, 6, 4, 2, 8, device=device)
    before = pool.clone()
    copy_pages_torch(pool, torch.tensor([0, 4], device=device), torch.tensor([5, 2], device=device))
    torch.testing.assert_close(pool[:, :, 5], before[:, :, 0])
    torch.testing.assert_close(pool[:, :, 2], before[:, :, 4])
    untouched = [0, 1, 3, 4]
    torch.testing.assert_close(pool[:, :, untouched], before[:, :, untouched])


def test_workspace_buffers_work_in_and_out_of_inference_mode():
    """A buffer first allocated under inference_mode (the model's forward) must stay usable by
    plain calls afterwards (an inference tensor cannot be written outside that mode)."""
    from prefixgate.kernels.workspace import gather_pages

    cache = torch.arange(4 * 2 * 1 * 3, dtype=torch.float64).view(4, 2, 1, 3)
    ids = torch.tensor([2, 0])
    with torch.inference_mode():
        inside = gather_pages(cache, ids, "inference-probe").clone()
    outside = gather_pages(cache, ids, "inference-probe")
    assert torch.equal(inside, outside) and torch.equal(outside, cache[ids])
