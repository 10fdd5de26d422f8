"""HF safetensors directories: tiny random models of each family vs transformers itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from prefixgate.engine.loader import UnsupportedModelError, load_hf, load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk
from tests.engine.tiny_models import VOCAB, tiny_hf_model

pytestmark = pytest.mark.slow

# 300 positions: long enough for every RoPE scaling variant to move the logits
PROMPT = [(17 + 37 * i) % VOCAB for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, hf_tokenizer):
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json...)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    hf_tokenizer.save_pretrained(directory)
    return directory


def _save(model, directory, tokenizer_files, **kwargs):
    model.save_pretrained(directory, **kwargs)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def _logits(directory, ids=PROMPT) -> torch.Tensor:
    runner = ModelRunner.from_loaded(
        load_model(directory), num_pages=24, page_size=16, device="cpu"
    )
    table = list(range(23, 3, -1))  # scattered, descending pages
    return runner.execute([SeqChunk(ids, 0, table, True)])[0]


def _reference(model, ids=PROMPT) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "rope-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        },
    ),
    "rope-yarn": (
        "llama",
        {
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "rope_theta": 10000.0,
            },
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_directory_matches_transformers(tmp_path, tokenizer_files, case):
    arch, overrides = CASES[case]
    model = tiny_hf_model(arch, seed=len(case), **overrides)
    directory = _save(model, tmp_path / case, tokenizer_files)
    diff = (_logits(directory) - _reference(model)).abs().max().item()
    assert diff < 1e-4, f"{case}: logits differ by {diff}"


def test_sharded_checkpoint(tmp_path, tokenizer_files):
    model = tiny_hf_model("llama", seed=5)
    directory = _save(model, tmp_path / "sharded", tokenizer_files, max_shard_size="1MB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    assert (_logits(directory) - _reference(model)).abs().max().item() < 1e-4


def test_bf16_checkpoint_is_upcast(tmp_path, tokenizer_files):
    model = tiny_hf_model("llama", seed=6)
    # NOTE: .to(bf16) also rounds the model's rotary buffers; the reference must not use those
    rounded = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    model.load_state_dict({name: t.float() for name, t in rounded.items()})
    directory = _save(model, tmp_path / "bf16", tokenizer_files)
    # overwrite the fp32 weights with the bf16 ones, as a bf16 checkpoint stores them
    save_file(rounded, str(directory / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_hf(directory)
    assert loaded.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert (_logits(directory) - _reference(model)).abs().max().item() < 1e-4


def test_tokenizer_and_chat_template_from_directory(tmp_path, tokenizer_files, hf_tokenizer):
    model = tiny_hf_model("llama", seed=7)
    loaded = load_hf(_save(model, tmp_path / "tok", tokenizer_files))
    tokenizer = loaded.tokenizer
    text = "Hello wörld 👋 <|im_start|>user\n12345\tdef f(): pass"
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.eos_token_ids[0] == hf_tokenizer.eos_token_id


def _config_dir(tmp_path, tokenizer_files, **changes):
    directory = _save(tiny_hf_model("llama", seed=8), tmp_path / "cfg", tokenizer_files)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_unsupported_configs_are_named(tmp_path, tokenizer_files):
    directory = _config_dir(tmp_path, tokenizer_files, model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported; supported: llama"):
        load_hf(directory)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    directory = _config_dir(tmp_path, tokenizer_files, rope_parameters=dynamic)
    with pytest.raises(
        UnsupportedModelError, match="'dynamic' is not supported; supported: linear"
    ):
        load_hf(directory)
    directory = _config_dir(tmp_path, tokenizer_files, hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        load_hf(directory)


def test_missing_pieces_are_named(tmp_path, tokenizer_files):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)
    directory = _config_dir(tmp_path, tokenizer_files)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModelError, match="no tokenizer.json"):
        load_hf(directory)
    shutil.copy(tokenizer_files / "tokenizer.json", directory / "tokenizer.json")
    (directory / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="no safetensors weights"):
        load_hf(directory)
