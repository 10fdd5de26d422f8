"""The native gated delta rule and causal conv (kernels/cpu/csrc/gated_delta.c) against the
torch reference (kernels/torch_cpu/gated_delta.py), and their own bit-identity: a sequence's
results are the same bits however its rows are split into calls, alone or batched."""

from __future__ import annotations

import shutil

import pytest
import torch

from prefixgate.kernels.cpu.gated_delta import (
    causal_conv1d_varlen_native,
    gated_delta_rule_fused_native,
    gated_delta_rule_varlen_native,
    prepare_inputs_torch,
)
from prefixgate.kernels.torch_cpu.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)

# fp32; the native sums over Dk run in another order than torch's (two partial sums, the decay
# applied to S^T k rather than to S first), so results differ by rounding only
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# odd Dk (the unpaired last row of the Dk loop), Dv over one 64-column block with a narrow
# second one (the zero-padded block), 3 heads
HEADS, DK, DV = 3, 33, 70


def _rule_inputs(total: int, seed: int, heads: int = HEADS, dk: int = DK, dv: int = DV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1)
    v = torch.randn(total, heads, dv, generator=gen)
    g = -torch.rand(total, heads, generator=gen)
    beta = torch.rand(total, heads, generator=gen)
    return [q * dk**-0.5, k, v, g, beta]


def _state(seqs: int, seed: int) -> torch.Tensor:
    return torch.randn(seqs, HEADS, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.1


def _rows(tensors: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    return [t[start:end] for t in tensors]


def _native(*args, **kwargs):
    result = gated_delta_rule_varlen_native(*args, **kwargs)
    assert result is not None, "the native library did not take fp32 CPU inputs"
    return result


def test_matches_reference_with_saves_and_an_empty_sequence() -> None:
    qsl = [0, 5, 6, 6, 206]  # a prefill chunk, a decode row, an empty sequence, a long one
    inputs = _rule_inputs(206, seed=0)
    state = _state(4, seed=1)
    saves = [2, 5, 100, 205]
    ref = gated_delta_rule_varlen(*inputs, state, qsl, save_rows=saves)
    got = _native(*inputs, state, qsl, save_rows=saves)
    for expected, actual in zip(ref, got, strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert torch.equal(got[1][2], state[2])  # the empty sequence's state passes through
    # a save after row 100 = the final state of the same rows run alone up to it
    _, part, _ = _native(*_rows(inputs, 6, 101), state[3:4], [0, 95])
    assert torch.equal(got[2][2], part[0])


@pytest.mark.parametrize("cuts", [(1,), (7,), (16, 17), tuple(range(1, 37))])
def test_split_anywhere_is_bit_identical(cuts: tuple[int, ...]) -> None:
    """Cold over 37 rows == the same rows in chunks through the carried state (down to one
    token per call: decode), outputs and final state, bit for bit."""
    inputs = _rule_inputs(37, seed=2)
    state = _state(1, seed=3)
    cold_out, cold_state, _ = _native(*inputs, state, [0, 37])
    outs, carried = [], state
    for start, end in zip((0, *cuts), (*cuts, 37), strict=True):
        out, carried, _ = _native(*_rows(inputs, start, end), carried, [0, end - start])
        outs.append(out)
    assert torch.equal(torch.cat(outs), cold_out)
    assert torch.equal(carried, cold_state)


def test_alone_equals_batched_at_any_position_and_stride() -> None:
    """One sequence alone (one thread: a small call) == the same rows inside a larger batch
    (the OpenMP path), at another offset and with its rows inside wider, strided buffers."""
    inputs = _rule_inputs(23, seed=4)
    state = _state(1, seed=5)
    alone_out, alone_state, alone_saved = _native(*inputs, state, [0, 23], save_rows=[9])
    others = _rule_inputs(61, seed=6)
    batch = [torch.cat([o[:41], t, o[41:]]) for o, t in zip(others, inputs, strict=True)]
    # the same values in strided views of a wider buffer (as splits of a fused projection)
    wide = [torch.cat([t, torch.zeros_like(t)], dim=-1 if t.dim() == 2 else 1) for t in batch]
    strided = [w[:, : t.shape[1]] for w, t in zip(wide, batch, strict=True)]
    assert not strided[0].is_contiguous()
    states = torch.cat([_state(1, 7), state, _state(1, 8)])
    for tensors in (batch, strided):
        out, final, saved = _native(*tensors, states, [0, 41, 64, 84], save_rows=[3, 50, 70])
        assert torch.equal(out[41:64], alone_out)
        assert torch.equal(final[1], alone_state[0])
        assert torch.equal(saved[1], alone_saved[0])


def test_in_place_final_state_and_value_heads_with_dk_not_dv() -> None:
    inputs = _rule_inputs(9, seed=9, heads=4, dk=16, dv=130)
    state = torch.randn(2, 4, 16, 130) * 0.1
    expected = gated_delta_rule_varlen(*inputs, state, [0, 8, 9])
    fresh = _native(*inputs, state, [0, 8, 9])
    for ref, got in zip(expected, fresh, strict=True):
        torch.testing.assert_close(got, ref, **TOLERANCE)
    in_place = state.clone()
    out, final, _ = _native(*inputs, in_place, [0, 8, 9], final_state=in_place)
    assert final is in_place
    assert torch.equal(out, fresh[0]) and torch.equal(in_place, fresh[1])


def test_fused_entry_matches_the_torch_preparation() -> None:
    """l2 norm, q scale, g and beta inside the kernel, one q/k head per 3 value heads: against
    prepare_inputs_torch + the reference, and split/batch bit-identical like the plain rule."""
    gen = torch.Generator().manual_seed(10)
    total = 30
    qk = torch.randn(total, 2, 1, DK, generator=gen) * 2  # raw q and k of one key head
    q, k = qk[:, 0], qk[:, 1]  # strided views, as splits of the conv output
    v = torch.randn(total, HEADS, DV, generator=gen)
    a, b = torch.randn(total, HEADS, generator=gen), torch.randn(total, HEADS, generator=gen)
    a_log, dt_bias = torch.randn(HEADS, generator=gen), torch.randn(HEADS, generator=gen)
    state = _state(2, seed=11)
    qsl = [0, 12, 30]
    prepared = prepare_inputs_torch(q, k, a, b, a_log, dt_bias, HEADS)
    ref = gated_delta_rule_varlen(prepared[0], prepared[1], v, *prepared[2:], state, qsl,
                                  save_rows=[4])
    got = gated_delta_rule_fused_native(q, k, v, a, b, a_log, dt_bias, state, qsl, save_rows=[4])
    assert got is not None
    for expected, actual in zip(ref, got, strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    first = gated_delta_rule_fused_native(q[12:20], k[12:20], v[12:20], a[12:20], b[12:20],
                                          a_log, dt_bias, state[1:], [0, 8])
    rest = gated_delta_rule_fused_native(q[20:], k[20:], v[20:], a[20:], b[20:], a_log, dt_bias,
                                         first[1], [0, 10])
    assert torch.equal(torch.cat([first[0], rest[0]]), got[0][12:])
    assert torch.equal(rest[1][0], got[1][1])


def test_declines_what_it_does_not_take() -> None:
    inputs = _rule_inputs(4, seed=12)
    state = _state(1, seed=13)
    assert gated_delta_rule_varlen_native(*[t.double() for t in inputs], state.double(),
                                          [0, 4]) is None
    assert gated_delta_rule_varlen_native(*inputs, state.transpose(2, 3).contiguous()
                                          .transpose(2, 3), [0, 4]) is None
    assert gated_delta_rule_varlen_native(*inputs, state, [0, 3]) is None  # rows != T
    assert causal_conv1d_varlen_native(torch.randn(4, 8).bfloat16(), torch.randn(8, 4),
                                       torch.zeros(1, 3, 8), [0, 4]) is None


def _conv_inputs(total: int, seqs: int, channels: int = 70, kernel: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, channels, generator=gen),
            torch.randn(channels, kernel, generator=gen),
            torch.randn(seqs, kernel - 1, channels, generator=gen))


def test_conv_matches_reference_and_splits_bit_identically() -> None:
    x, weight, state = _conv_inputs(40, 4, seed=14)
    qsl = [0, 2, 2, 3, 40]  # shorter than the window, empty, one row, long
    saves = [0, 1, 2, 20, 39]
    ref = causal_conv1d_varlen(x, weight, state, qsl, save_rows=saves)
    got = causal_conv1d_varlen_native(x, weight, state, qsl, save_rows=saves)
    assert got is not None
    torch.testing.assert_close(got[0], ref[0], **TOLERANCE)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])  # copies of inputs
    # the last sequence in pieces (strided rows), alone: the same bits
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, : x.shape[1]]
    outs, carried = [], state[3:4]
    for start, end in ((3, 4), (4, 5), (5, 17), (17, 40)):
        out, carried, _ = causal_conv1d_varlen_native(wide[start:end], weight, carried,
                                                      [0, end - start])
        outs.append(out)
    assert torch.equal(torch.cat(outs), got[0][3:]) and torch.equal(carried[0], got[1][3])


def test_state_slots_read_a_pool_and_update_it_in_place() -> None:
    """With state_slots the states are read at each sequence's entry of a pool: the same bits
    as the batch gathered out of it; with final_state=pool they are written back there in
    place, the other entries untouched."""
    inputs = _rule_inputs(12, seed=15)
    pool = _state(5, seed=16)
    before = pool.clone()
    slots, qsl = [3, 0], [0, 7, 12]
    expected = _native(*inputs, pool[slots], qsl, save_rows=[2])
    read = _native(*inputs, pool, qsl, save_rows=[2], state_slots=slots)
    for want, got in zip(expected, read, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(pool, before)
    out, final, saved = _native(*inputs, pool, qsl, save_rows=[2], state_slots=slots,
                                final_state=pool)
    assert final is pool and torch.equal(out, expected[0]) and torch.equal(saved, expected[2])
    assert torch.equal(pool[slots], expected[1])
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])
    assert gated_delta_rule_varlen_native(*inputs, pool, qsl, state_slots=[1, 1]) is None
    x, weight, conv_pool = _conv_inputs(12, 4, seed=17)
    conv_before = conv_pool.clone()
    expected = causal_conv1d_varlen_native(x, weight, conv_pool[[2, 1]], [0, 2, 12], [1])
    read = causal_conv1d_varlen_native(x, weight, conv_pool, [0, 2, 12], [1], state_slots=[2, 1])
    assert expected is not None and read is not None and torch.equal(conv_pool, conv_before)
    for want, got in zip(expected, read, strict=True):
        assert torch.equal(got, want)
    got = causal_conv1d_varlen_native(x, weight, conv_pool, [0, 2, 12], [1], state_slots=[2, 1],
                                      final_state=conv_pool)
    assert got is not None and got[1] is conv_pool and torch.equal(got[0], expected[0])
    assert torch.equal(conv_pool[[2, 1]], expected[1])
    assert torch.equal(conv_pool[[0, 3]], conv_before[[0, 3]])
