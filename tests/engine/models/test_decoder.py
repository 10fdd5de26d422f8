"""models/decoder.py options the family fixtures do not cover, against transformers."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import transformers

from prefixgate.engine.loader import load_gguf, load_model
from prefixgate.engine.models.moe import StackedExperts
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels import dispatch
from prefixgate.kernels.cpu.ops import quant_native_available
from prefixgate.kernels.quant import QuantizedTensor
from tests.engine.models.conftest import make_runner
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL
from tests.family_fixtures import family_fixture, quantized_gguf

pytestmark = pytest.mark.slow


def test_qwen3_with_attention_biases_matches_transformers(tmp_path):
    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(family_fixture("qwen3").hf_dir / name, tmp_path / name)
    loaded = load_model(tmp_path)
    assert loaded.config.attention_bias and loaded.config.attention_out_bias
    ids = list(range(100, 140))
    runner = make_runner(loaded)
    ours = runner.execute([SeqChunk(ids, 0, [0, 1, 2], True)])[0]
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -1]
    assert (ours - reference).abs().max().item() < PREFILL_ATOL


@pytest.mark.parametrize("name", ["gemma3", "phi3", "qwen3_moe", "granite"])
def test_q8_0_gguf_computes_in_its_blocks_like_dequantized(name):
    loaded = load_gguf(quantized_gguf(name, "Q8_0"))
    ids = list(range(200, 245))
    blocks = make_runner(loaded)
    # the same file's values dequantized (one read of the file: big vocabularies parse slowly)
    dense_weights = {
        key: value.dequantize() if isinstance(value, QuantizedTensor | StackedExperts) else value
        for key, value in loaded.weights.items()
    }
    dense = make_runner(dataclasses.replace(loaded, weights=dense_weights))
    if quant_native_available():  # fused q|k|v (Phi: split from attn_qkv) stays in its blocks
        assert blocks.model.layers[0].qkv.quant == "Q8_0"
        if name == "qwen3_moe":  # and each expert's gate|up and down
            assert {p.quant for e in blocks.model.layers[0].mlp.experts for p in e} == {"Q8_0"}
    assert dense.model.layers[0].qkv.quant is None
    ours = blocks.execute([SeqChunk(ids, 0, [0, 1, 2], True)])[0]
    reference = dense.execute([SeqChunk(ids, 0, [0, 1, 2], True)])[0]
    assert (ours - reference).abs().max().item() < LAYOUT_ATOL


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_the_forward_resolves_no_kernel_backend(monkeypatch, name):
    # every layer, sliding ones included, goes through the backend bound at runner start: a
    # per-call resolution (kernels.write_kv / paged_attention) would hit the patched registry
    runner = make_runner(load_model(family_fixture(name).hf_dir))
    ids = list(range(100, 140))  # past Gemma's 8-token window
    before = runner.execute([SeqChunk(ids, 0, [0, 1, 2], True)])[0]

    def resolved_per_call(*_args, **_kwargs):
        raise AssertionError("a kernel backend was resolved during the forward")

    monkeypatch.setattr(dispatch, "resolve_backend", resolved_per_call)
    monkeypatch.setattr(dispatch, "_ops", resolved_per_call)
    assert torch.equal(runner.execute([SeqChunk(ids, 0, [3, 4, 5], True)])[0], before)


def test_gemma3_sliding_layers_on_the_triton_backend_match_transformers():
    # the Triton kernels' window (in the interpreter here): chunks and a decode step that read
    # Gemma 3's 8-token local layers across page and window boundaries
    pytest.importorskip("triton")
    fixture = family_fixture("gemma3")
    runner = ModelRunner.from_loaded(
        load_model(fixture.hf_dir), num_pages=8, page_size=16, device="cpu",
        dtype="fp32", kernel_backend="triton", native_kernels=False,
    )  # fmt: skip
    ids = list(range(100, 141))
    with torch.inference_mode():
        reference = fixture.hf_model()(torch.tensor([ids])).logits[0]
    table = [5, 2, 7]
    for start, end in ((0, 21), (21, 40), (40, 41)):  # the last one: a decode row
        ours = runner.execute([SeqChunk(ids[start:end], start, table, True)])[0]
        assert (ours - reference[end - 1]).abs().max().item() < PREFILL_ATOL
