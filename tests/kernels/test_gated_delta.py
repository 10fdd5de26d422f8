"""The gated delta rule's torch reference (kernels/torch_cpu/gated_delta.py) against
transformers' recurrent and chunked forms, and its chunking invariance (bit-exact)."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.torch_cpu.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(total: int, heads: int = 2, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1)
    v = torch.randn(total, heads, dv, generator=gen)
    g = -torch.rand(total, heads, generator=gen)
    beta = torch.rand(total, heads, generator=gen)
    return q, k, v, g, beta


def test_matches_transformers_recurrent_and_chunked() -> None:
    lens = [5, 1, 23]
    qsl = [0, 5, 6, 29]
    q, k, v, g, beta = _inputs(29)
    state = torch.randn(3, 2, 8, 6) * 0.1
    out, final, saved = gated_delta_rule_varlen(q, k, v, g, beta, state, qsl, save_rows=[2, 15])
    for s, n in enumerate(lens):
        rows = slice(qsl[s], qsl[s] + n)
        # transformers normalises and scales inside; undo ours: feed q unscaled, k as is
        ref, ref_state = hf.torch_recurrent_gated_delta_rule(
            (q[rows] * 8**0.5)[None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
            initial_state=state[s : s + 1].clone(), output_final_state=True)
        torch.testing.assert_close(out[rows], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[s], ref_state[0], rtol=1e-5, atol=1e-5)
        chunked, chunk_state = hf.torch_chunk_gated_delta_rule(
            (q[rows] * 8**0.5)[None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
            initial_state=state[s : s + 1].clone(), output_final_state=True)
        torch.testing.assert_close(out[rows], chunked[0], rtol=1e-4, atol=1e-4)
    # a save after row 15 = the state of sequence 2 after its 10th token
    _, part, _ = gated_delta_rule_varlen(q[6:16], k[6:16], v[6:16], g[6:16], beta[6:16],
                                         state[2:3], [0, 10])
    assert torch.equal(saved[1], part[0])


def test_split_anywhere_is_bit_identical() -> None:
    """Cold over 23 rows == the same rows in two chunks through the carried state, and alone
    == batched with other sequences (the hybrid cache's cached = uncached contract)."""
    q, k, v, g, beta = _inputs(23, seed=1)
    state = torch.zeros(1, 2, 8, 6)
    cold, cold_state, _ = gated_delta_rule_varlen(q, k, v, g, beta, state, [0, 23])
    for cut in (1, 7, 16):
        a, mid, _ = gated_delta_rule_varlen(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state, [0, cut])
        b, end, _ = gated_delta_rule_varlen(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], mid, [0, 23 - cut])
        assert torch.equal(torch.cat([a, b]), cold) and torch.equal(end, cold_state)
    qo, ko, vo, go, bo = _inputs(4, seed=2)
    batched, states, _ = gated_delta_rule_varlen(
        torch.cat([qo, q]), torch.cat([ko, k]), torch.cat([vo, v]), torch.cat([go, g]),
        torch.cat([bo, beta]), torch.cat([torch.randn(1, 2, 8, 6), state]), [0, 4, 27])
    assert torch.equal(batched[4:], cold) and torch.equal(states[1], cold_state[0])


def test_conv_matches_transformers_and_carries_state() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 5, generator=gen)
    weight = torch.randn(5, 4, generator=gen)
    zero = torch.zeros(2, 3, 5)
    out, new_state, saved = causal_conv1d_varlen(x, weight, zero, [0, 4, 11], save_rows=[1, 9])
    for s, (a, b) in enumerate(((0, 4), (4, 11))):
        ref = hf.causal_conv1d_fn(x[a:b].t()[None], weight, None, activation="silu")[0].t()
        torch.testing.assert_close(out[a:b], ref)
        padded = torch.cat([torch.zeros(3, 5), x[a:b]])
        assert torch.equal(new_state[s], padded[-3:])
    assert torch.equal(saved[0], torch.cat([torch.zeros(1, 5), x[0:2]]))
    assert torch.equal(saved[1], x[7:10])
    # continuing from the carried state == one run
    first, mid, _ = causal_conv1d_varlen(x[4:7], weight, zero[:1], [0, 3])
    rest, _, _ = causal_conv1d_varlen(x[7:11], weight, mid, [0, 4])
    assert torch.equal(torch.cat([first, rest]), out[4:11])
