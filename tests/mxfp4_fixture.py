"""A tiny gpt-oss checkpoint with MXFP4 experts, as the released gpt-oss checkpoints store them.

transformers cannot write one on CPU (its MXFP4 quantizer needs triton kernels), so the blocks
are written here: transformers' GptOssForCausalLM from ``GPT_OSS_CONFIG`` with an intermediate
size of 64 (MXFP4 blocks are 32 weights along k: the down projection's k is the intermediate
size; the bf16 fixture's 48 is not a multiple), every expert matrix quantized by
kernels/torch_cpu/mxfp4.py's quantizer (the OCP spec as gguf-py does it, checked against
gguf-py bit for bit in tests/kernels/test_linear_mxfp4.py) and saved as HF's
``*_blocks`` / ``*_scales`` with ``quantization_config: {quant_method: mxfp4}``; attention,
router, embeddings and biases as they were. transformers reads it back (``Mxfp4Config(
dequantize=True)``), which makes it the oracle on the dequantized weights.

``gpt_oss_mxfp4_gguf``: llama.cpp's own converter run on that folder (opt-in, as the bf16
fixture's GGUF: ``PREFIXGATE_LLAMA_CPP_CONVERTER=1``): experts as ggml MXFP4, the rest f32.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.family_fixtures import _build_once, fixture_root, template
from tests.harmony_fixture import (
    GPT_OSS_CONFIG,
    HARMONY_TEMPLATE,
    harmony_tokenizer_dir,
)

MXFP4_CONFIG = {**GPT_OSS_CONFIG, "intermediate_size": 64}
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}  # fmt: skip


def _mxfp4_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, in, out]`` (transformers' parameter layout) -> HF ``(blocks, scales)`` per expert
    ``[out, in]``, stacked."""
    from prefixgate.kernels.torch_cpu.mxfp4 import quantize_mxfp4

    pairs = [quantize_mxfp4(expert.T.contiguous()).to_hf() for expert in stacked]
    return torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])


def _build(tmp: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**MXFP4_CONFIG)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)  # big enough to move the logits
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = _mxfp4_experts(state.pop(name))
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(tmp))
    model.generation_config.save_pretrained(str(tmp))
    config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = QUANTIZATION_CONFIG
    config["architectures"] = ["GptOssForCausalLM"]  # model.save_pretrained would write it
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(harmony_tokenizer_dir() / name, tmp / name)
    (tmp / "chat_template.jinja").write_text(template(HARMONY_TEMPLATE), encoding="utf-8")


def gpt_oss_mxfp4_dir() -> Path:
    """The tiny gpt-oss with MXFP4 experts (HF layout), built once and cached."""
    return _build_once(fixture_root() / "gpt-oss-tiny-mxfp4-v1", _build)


def _convert(tmp: Path) -> None:
    from tests.engine.models.test_llama_cpp_converter import llama_cpp_converter

    tool = llama_cpp_converter()
    subprocess.run(
        [sys.executable, str(tool / "convert_hf_to_gguf.py"), str(gpt_oss_mxfp4_dir()),
         "--outfile", str(tmp / "gpt-oss-tiny-mxfp4.gguf"), "--outtype", "f32"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tool / "gguf-py")},
    )  # fmt: skip


def gpt_oss_mxfp4_gguf() -> Path:
    """llama.cpp's converter's GGUF of :func:`gpt_oss_mxfp4_dir` (experts in ggml MXFP4)."""
    return _build_once(fixture_root() / "gpt-oss-tiny-mxfp4-gguf-v1", _convert) \
        / "gpt-oss-tiny-mxfp4.gguf"


def transformers_oracle(folder: Path | None = None) -> torch.nn.Module:
    """transformers' GptOssForCausalLM on the fixture, its MXFP4 experts dequantized by
    transformers itself, fp32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        str(folder or gpt_oss_mxfp4_dir()), dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True)).eval()  # fmt: skip
