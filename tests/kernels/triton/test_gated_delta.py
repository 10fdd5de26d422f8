"""Triton gated delta rule and causal conv against the torch reference (interpreter on CPU,
real GPU on CUDA), and their own bit-identity across splits and batches. Tiny shapes: the
interpreter walks every token in Python."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.cpu.gated_delta import prepare_inputs_torch  # noqa: E402
from prefixgate.kernels.torch_cpu.gated_delta import (  # noqa: E402
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
)
from prefixgate.kernels.triton.gated_delta import (  # noqa: E402
    causal_conv1d_varlen_triton,
    gated_delta_rule_fused_triton,
    gated_delta_rule_varlen_triton,
)
from tests.kernels.paged_case import DEVICES  # noqa: E402

# fp32 sums in another order than torch's (and the GPU's approximate exp): rounding only
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
HEADS, DK, DV = 2, 6, 5  # non-powers of two: masked tiles


def _inputs(total: int, seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(total, HEADS, DK, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(total, HEADS, DK, generator=gen), dim=-1)
    v = torch.randn(total, HEADS, DV, generator=gen)
    g, beta = -torch.rand(total, HEADS, generator=gen), torch.rand(total, HEADS, generator=gen)
    return [t.to(device) for t in (q * DK**-0.5, k, v, g, beta)]


def _state(seqs: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(seqs, HEADS, DK, DV, generator=gen) * 0.1).to(device)


def _cpu(result):
    return [t.cpu() for t in result]


@pytest.mark.parametrize("device", DEVICES)
def test_rule_matches_reference_and_is_split_and_batch_invariant(device: str) -> None:
    qsl = [0, 3, 3, 4, 9]  # a chunk, an empty sequence, a decode row, a longer chunk
    inputs = _inputs(9, seed=0, device=device)
    state = _state(4, seed=1, device=device)
    ref = gated_delta_rule_varlen(*[t.cpu() for t in inputs], state.cpu(), qsl, save_rows=[1, 6])
    got = _cpu(gated_delta_rule_varlen_triton(*inputs, state, qsl, save_rows=[1, 6]))
    for expected, actual in zip(ref, got, strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    # the last sequence alone, in two calls through the carried state: the same bits
    first = gated_delta_rule_varlen_triton(*[t[4:6] for t in inputs], state[3:], [0, 2])
    rest = gated_delta_rule_varlen_triton(*[t[6:] for t in inputs], first[1], [0, 3],
                                          save_rows=[0])
    assert torch.equal(torch.cat([first[0], rest[0]]).cpu(), got[0][4:])
    assert torch.equal(rest[1][0].cpu(), got[1][3])
    assert torch.equal(rest[2][0].cpu(), got[2][1])
    in_place = state.clone()
    out, final, _ = gated_delta_rule_varlen_triton(*inputs, in_place, qsl, final_state=in_place)
    assert final is in_place and torch.equal(out.cpu(), got[0])
    assert torch.equal(in_place.cpu(), got[1])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rule_matches_the_torch_preparation(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    qk = torch.randn(5, 2, 1, DK, generator=gen) * 2  # one q/k head for both value heads
    v = torch.randn(5, HEADS, DV, generator=gen)
    a, b = torch.randn(5, HEADS, generator=gen), torch.randn(5, HEADS, generator=gen)
    a_log, dt_bias = torch.randn(HEADS, generator=gen), torch.randn(HEADS, generator=gen)
    state = _state(2, seed=3, device="cpu")
    prepared = prepare_inputs_torch(qk[:, 0], qk[:, 1], a, b, a_log, dt_bias, HEADS)
    ref = gated_delta_rule_varlen(prepared[0], prepared[1], v, *prepared[2:], state, [0, 2, 5])
    on = [t.to(device) for t in (qk, v, a, b, a_log, dt_bias, state)]
    got = _cpu(gated_delta_rule_fused_triton(on[0][:, 0], on[0][:, 1], *on[1:], [0, 2, 5]))
    for expected, actual in zip(ref, got, strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_matches_reference_and_carries_state(device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 2 * 7, generator=gen)[:, :7]  # strided rows
    weight, state = torch.randn(7, 4, generator=gen), torch.randn(3, 3, 7, generator=gen)
    qsl, saves = [0, 2, 2, 8], [0, 1, 5]  # shorter than the window, empty, longer
    ref = causal_conv1d_varlen(x, weight, state, qsl, save_rows=saves)
    on = [t.to(device) for t in (x, weight, state)]
    got = _cpu(causal_conv1d_varlen_triton(*on, qsl, save_rows=saves))
    torch.testing.assert_close(got[0], ref[0], **TOLERANCE)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])  # copies of inputs
    first = causal_conv1d_varlen_triton(on[0][2:3], on[1], on[2][2:], [0, 1])
    rest = causal_conv1d_varlen_triton(on[0][3:], on[1], first[1], [0, 5])
    assert torch.equal(torch.cat([first[0], rest[0]]).cpu(), got[0][2:])
    assert torch.equal(rest[1][0].cpu(), got[1][2])


def test_launcher_rejects_bad_inputs() -> None:
    inputs = _inputs(4, seed=5, device=DEVICES[0])
    state = _state(1, seed=6, device=DEVICES[0])
    with pytest.raises(ValueError, match="query_start_loc"):
        gated_delta_rule_varlen_triton(*inputs, state, [0, 3])
    with pytest.raises(ValueError, match="state must be fp32"):
        gated_delta_rule_varlen_triton(*inputs, state.double(), [0, 4])
    with pytest.raises(ValueError, match="save_rows"):
        gated_delta_rule_varlen_triton(*inputs, state, [0, 4], save_rows=[4])


@pytest.mark.parametrize("device", DEVICES)
def test_state_slots_read_a_pool_and_update_it_in_place(device: str) -> None:
    inputs = _inputs(5, seed=7, device=device)
    pool = _state(4, seed=8, device=device)
    before = pool.clone()
    expected = gated_delta_rule_varlen_triton(*inputs, pool[[2, 0]], [0, 3, 5], save_rows=[1])
    read = gated_delta_rule_varlen_triton(*inputs, pool, [0, 3, 5], save_rows=[1],
                                          state_slots=[2, 0])
    assert all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))
    assert torch.equal(pool, before)
    out, final, saved = gated_delta_rule_varlen_triton(*inputs, pool, [0, 3, 5], save_rows=[1],
                                                       state_slots=[2, 0], final_state=pool)
    assert final is pool and torch.equal(out, expected[0]) and torch.equal(saved, expected[2])
    assert torch.equal(pool[[2, 0]], expected[1]) and torch.equal(pool[[1, 3]], before[[1, 3]])
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 7, generator=gen).to(device)
    weight = torch.randn(7, 4, generator=gen).to(device)
    conv_pool = torch.randn(3, 3, 7, generator=gen).to(device)
    conv_before = conv_pool.clone()
    expected = causal_conv1d_varlen_triton(x, weight, conv_pool[[1, 2]], [0, 1, 5])
    read = causal_conv1d_varlen_triton(x, weight, conv_pool, [0, 1, 5], state_slots=[1, 2])
    assert all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))
    got = causal_conv1d_varlen_triton(x, weight, conv_pool, [0, 1, 5], state_slots=[1, 2],
                                      final_state=conv_pool)
    assert got[1] is conv_pool and torch.equal(got[0], expected[0])
    assert torch.equal(conv_pool[[1, 2]], expected[1])
    assert torch.equal(conv_pool[0], conv_before[0])
