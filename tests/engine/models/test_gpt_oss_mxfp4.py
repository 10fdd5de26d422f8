"""gpt-oss with MXFP4 experts (tests/mxfp4_fixture.py) against transformers on the dequantized
weights (transformers' own ``Mxfp4Config(dequantize=True)``), fp32, CPU.

The experts stay in their blocks and run on the native MXFP4 kernel (kernels/cpu/mxfp4.py); the
oracle expands them. The kernel's weights are exact and its activations fp32, so the bounds are
the bf16 fixture's (tests/engine/models/test_gpt_oss.py).
"""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.mxfp4 import Mxfp4Linear, mxfp4_native_path
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Experts
from tests.engine.models.greedy import greedy_after
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL, Pages
from tests.mxfp4_fixture import gpt_oss_mxfp4_dir, transformers_oracle

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def case():
    loaded = load_model(gpt_oss_mxfp4_dir())
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about paged caches and sliding windows."}])
    return loaded, transformers_oracle(), prompt


def _runner(loaded, native: bool = True) -> ModelRunner:
    return ModelRunner.from_loaded(loaded, num_pages=64, page_size=16, device="cpu",
                                   dtype="fp32", native_kernels=native)


def _experts(runner: ModelRunner) -> list:
    return [pair for layer in runner.model.layers for pair in layer.mlp.experts]



def test_the_experts_stay_in_blocks_and_equal_transformers_dequantization(case):
    loaded, oracle, _ = case
    for i, layer in enumerate(oracle.model.layers):
        stem = f"model.layers.{i}.mlp.experts."
        gate, up, down = (loaded.weights[stem + p + "_proj.weight"] for p in ("gate", "up", "down"))
        assert all(isinstance(w, Mxfp4Experts) for w in (gate, up, down))
        theirs = layer.mlp.experts  # [E, H, 2I] gate|up interleaved, [E, I, H]
        assert torch.equal(gate.dequantize(), theirs.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(up.dequantize(), theirs.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(down.dequantize(), theirs.down_proj.transpose(1, 2))
        # 4.25 bits per weight: 17 bytes per 32 weights
        assert gate.nbytes == gate.shape[0] * gate.shape[1] * gate.shape[2] * 17 // 32


@pytest.mark.skipif(mxfp4_native_path() is None, reason="no native CPU library here")
def test_prefill_and_greedy_match_transformers_on_the_native_kernel(case):
    loaded, oracle, prompt = case
    runner = _runner(loaded)
    assert all(isinstance(layer, Mxfp4Linear) and layer.native
               for pair in _experts(runner) for layer in pair)
    pages = Pages(runner, seed=5)
    table = pages.take(len(prompt) + NEW_TOKENS)
    bounds = [0, 5, 16, 17, 31, len(prompt)]  # page-aligned and not, a 1-token chunk
    with torch.inference_mode():
        reference = oracle(torch.tensor([prompt])).logits[0].float()
    for start, end in zip(bounds, bounds[1:], strict=False):
        ours = runner.execute([SeqChunk(prompt[start:end], start, table, True)])[0]
        diff = (ours - reference[end - 1]).abs().max().item()
        assert diff < PREFILL_ATOL, f"chunk {start}:{end} logits differ by {diff}"
    tokens = greedy_after(runner, prompt, table, ours, NEW_TOKENS)
    with torch.inference_mode():
        again = oracle(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert again.argmax(-1).tolist() == tokens


def test_cached_equals_uncached_alone_equals_batched_and_the_torch_path_agrees(case):
    loaded, _, prompt = case
    runner = _runner(loaded, native=mxfp4_native_path() is not None)
    pages = Pages(runner, seed=11)
    fresh_table = pages.take(len(prompt) + NEW_TOKENS)
    fresh = runner.execute([SeqChunk(prompt, 0, fresh_table, True)])[0]
    alone = greedy_after(runner, prompt, fresh_table, fresh, NEW_TOKENS)
    cached = (len(prompt) - 1) // 16 * 16
    prefix_table = pages.take(cached)
    runner.execute([SeqChunk(prompt[:cached], 0, prefix_table, False)])
    table = prefix_table + pages.take(len(prompt) + NEW_TOKENS - cached)
    hit = runner.execute([SeqChunk(prompt[cached:], cached, table, True)])[0]
    assert (hit - fresh).abs().max().item() < LAYOUT_ATOL
    assert greedy_after(runner, prompt, table, hit, NEW_TOKENS) == alone
    prompts = [prompt[: len(prompt) // 2], prompt, prompt[3:]]
    tables = [pages.take(len(p) + NEW_TOKENS) for p in prompts]
    first = runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    assert greedy_after(runner, prompts[1], tables[1], first[1], NEW_TOKENS) == alone
    torch_runner = _runner(loaded, native=False)
    assert not any(layer.native for pair in _experts(torch_runner) for layer in pair)
    torch_table = Pages(torch_runner).take(len(prompt) + NEW_TOKENS)
    torch_first = torch_runner.execute([SeqChunk(prompt, 0, torch_table, True)])[0]
    assert greedy_after(torch_runner, prompt, torch_table, torch_first, NEW_TOKENS) == alone


def test_another_quantization_method_is_refused_with_a_clear_error():
    from prefixgate.engine.model_config import UnsupportedModelError
    from prefixgate.engine.models.gpt_oss import _hf_config

    raw = {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "intermediate_size": 64, "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(UnsupportedModelError, match="bitsandbytes.*MXFP4"):
        _hf_config(raw)
    _hf_config({**raw, "quantization_config": {"quant_method": "mxfp4"}})  # accepted


def test_a_blocks_tensor_without_its_scales_is_refused():
    from prefixgate.engine.model_config import UnsupportedModelError
    from prefixgate.engine.models.gpt_oss import _adapt_hf

    weights = {"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(4, 64, 2, 16,
                                                                          dtype=torch.uint8)}
    with pytest.raises(UnsupportedModelError, match="down_proj_scales"):
        _adapt_hf(weights, None, "hf")
