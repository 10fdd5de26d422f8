"""models/moe.py: the routed MLP against computing every expert densely, only the chosen
experts touched, and the backend's grouped experts op in the model against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixgate import kernels
from prefixgate.engine.loader import load_model
from prefixgate.engine.models.moe import GroupedMoEMLP, MoEMLP
from prefixgate.engine.runner import ModelRunner, SeqChunk
from tests.engine.test_fidelity import PREFILL_ATOL
from tests.family_fixtures import family_fixture

EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 16, 8


def _moe(seed: int = 0) -> tuple[MoEMLP, torch.Tensor, torch.Tensor]:
    """The MLP and its stacked gate_up / down (the experts compute on views of them)."""
    torch.manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, INTER) * 0.3
    router = torch.randn(EXPERTS, HIDDEN)
    moe = MoEMLP.from_stacked(router, gate_up, down, top_k=TOP_K, normalize=True)
    return moe, gate_up, down


def _dense(moe: MoEMLP, gate_up_w: torch.Tensor, down_w: torch.Tensor, x: torch.Tensor):
    probs = F.linear(x, moe.router).softmax(-1)
    weights, chosen = probs.topk(TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(EXPERTS):
        gate_up = F.linear(x, gate_up_w[e])
        y = F.linear(F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], down_w[e])  # [T, H]
        weight = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 where e was not chosen
        out += weight * y
    return out


def test_routed_mlp_equals_dense_mixture():
    moe, gate_up, down = _moe()
    x = torch.randn(23, HIDDEN)
    torch.testing.assert_close(moe(x), _dense(moe, gate_up, down, x))


def test_unchosen_experts_are_never_computed():
    moe, gate_up, down = _moe(1)
    x = torch.randn(2, HIDDEN)  # 4 choices of 6 experts: at least 2 unchosen
    _, chosen = moe.route(x)
    unused = sorted(set(range(EXPERTS)) - set(chosen.flatten().tolist()))
    assert unused
    before = moe(x)
    gate_up[unused] = float("nan")  # any read of these would poison the output
    down[unused] = float("nan")
    assert torch.equal(moe(x), before)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_experts_of_the_bound_backend_match_transformers(backend):
    # without the native CPU ops the model binds its backend's grouped experts op (on Triton,
    # the grouped GEMM, here in the interpreter); the logits are transformers' all the same
    if backend == "triton":
        pytest.importorskip("triton")
    fixture = family_fixture("qwen3_moe")
    loaded = load_model(fixture.hf_dir)
    runner = ModelRunner.from_loaded(
        loaded, num_pages=8, page_size=16, device="cpu", dtype="fp32",
        kernel_backend=backend, native_kernels=False,
    )  # fmt: skip
    mlp = runner.model.layers[0].mlp
    assert isinstance(mlp, GroupedMoEMLP) and mlp.op is kernels.moe_experts_op(backend)
    ids = list(range(300, 333))
    ours = runner.execute([SeqChunk(ids, 0, [0, 1, 2], True)])[0]
    with torch.inference_mode():
        reference = fixture.hf_model()(torch.tensor([ids])).logits[0, -1]
    assert (ours - reference).abs().max().item() < PREFILL_ATOL
