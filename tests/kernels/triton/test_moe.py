"""The Triton MoE grouped GEMM against the oracle and the torch backend's experts (interpreter
on CPU, real GPU on CUDA): only the chosen experts are read, blocks padded per expert."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from prefixgate.kernels.torch_cpu.moe import moe_experts_torch  # noqa: E402
from prefixgate.kernels.triton.moe import align_pairs, moe_experts_triton  # noqa: E402
from tests.kernels.oracle import naive_moe_experts  # noqa: E402
from tests.kernels.paged_case import DEVICES, TOLERANCES  # noqa: E402

EXPERTS, HIDDEN, INTER = 6, 40, 24  # not multiples of the tiles: masked edges


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen) * 0.5
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    scores = torch.rand(num_tokens, EXPERTS, generator=gen)
    weights, experts = scores.softmax(-1).topk(top_k, -1)
    return tuple(t.to(device, dtype) for t in (x, gate_up, down, weights)) + (experts.to(device),)


def test_pairs_are_grouped_by_expert_in_padded_blocks():
    experts = torch.tensor([[2, 0], [2, 5], [0, 2]])  # expert 0: pairs 1, 4; 2: 0, 2, 5; 5: 3
    pairs, block_expert = align_pairs(experts, EXPERTS, 2)
    sentinel = experts.numel()
    assert block_expert.tolist()[:4] == [0, 2, 2, 5] and set(block_expert.tolist()[4:]) == {-1}
    assert pairs.tolist()[:8] == [1, 4, 0, 2, 5, sentinel, 3, sentinel]
    assert set(pairs.tolist()[8:]) == {sentinel}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "top_k", "block_m"), [(1, 2, None), (21, 2, 16),
                                                              (37, 3, 64)])
def test_matches_the_oracle_and_the_torch_experts(device, dtype, num_tokens, top_k, block_m):
    x, gate_up, down, weights, experts = _case(num_tokens, top_k, dtype, device)
    out = moe_experts_triton(x, gate_up, down, weights, experts, block_m=block_m)
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = TOLERANCES[dtype]
    want = naive_moe_experts(x, gate_up, down, weights, experts)
    torch.testing.assert_close(out.cpu().double(), want, **tolerance)
    if dtype == torch.float32:  # the torch experts: the same oracle, the same answer
        torch.testing.assert_close(
            moe_experts_torch(x, gate_up, down, weights, experts).cpu().double(), want, **tolerance
        )


@pytest.mark.parametrize("device", DEVICES)
def test_unchosen_experts_are_never_read(device):
    x, gate_up, down, weights, experts = _case(3, 1, torch.float32, device, seed=4)
    unused = sorted(set(range(EXPERTS)) - set(experts.flatten().tolist()))
    assert unused
    before = moe_experts_triton(x, gate_up, down, weights, experts)
    gate_up[unused] = float("nan")  # any read of these would poison the output
    down[unused] = float("nan")
    assert torch.equal(moe_experts_triton(x, gate_up, down, weights, experts), before)
