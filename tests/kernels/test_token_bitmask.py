"""kernels/token_bitmask.py: the native loop equals the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.cpu.library import library
from prefixgate.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

needs_native = pytest.mark.skipif(library() is None, reason="the native library does not build here")


def _bits(allowed: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V/32)] int32, bit j of word w = token 32w + j."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (padded.view(rows, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("vocab", [32, 33, 100, 49152])
def test_reference_masks_exactly_the_forbidden_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(4, vocab, generator=g) < 0.3
    allowed[1] = True  # a free row (all ones)
    logits = torch.randn(4, vocab, generator=g)
    expected = torch.where(allowed, logits, torch.tensor(float("-inf")))
    apply_token_bitmask_ref(logits, _bits(allowed))
    assert torch.equal(logits, expected)


@needs_native
@pytest.mark.parametrize("vocab", [1, 31, 32, 65, 49152])
def test_native_equals_reference_at_any_row_stride(vocab):
    g = torch.Generator().manual_seed(vocab + 1)
    allowed = torch.rand(5, vocab, generator=g) < 0.5
    allowed[2] = True
    allowed[3] = False  # nothing allowed: the whole row is -inf
    bitmask = _bits(allowed)
    wide = torch.randn(5, vocab + 7, generator=g)
    logits = wide[:, :vocab]  # rows strided (stride vocab + 7), the tail must stay untouched
    tail = wide[:, vocab:].clone()
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.equal(wide[:, vocab:], tail)
    assert bool(torch.isinf(logits[3]).all())


def test_bad_shapes_and_dtypes_are_refused():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="share B"):
        apply_token_bitmask(logits, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="words"):
        apply_token_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32))
