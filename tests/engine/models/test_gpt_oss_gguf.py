"""gpt-oss's GGUF as llama.cpp's own converter writes it (``convert_hf_to_gguf.py`` of the
sdist, tests/engine/models/test_llama_cpp_converter.py) from the tiny gpt-oss fixture: the same
config, tokenizer (o200k, llama.cpp's ``gpt-4o`` pre-tokenizer) and logits as transformers.
Opt-in like the converter test (``PREFIXGATE_LLAMA_CPP_CONVERTER=1``): the conversion takes
about 30 s once (cached beside the fixtures)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixgate.engine.loader import load_model
from prefixgate.engine.runner import ModelRunner, SeqChunk
from tests.engine.models.test_llama_cpp_converter import llama_cpp_converter
from tests.engine.test_fidelity import PREFILL_ATOL
from tests.family_fixtures import _build_once, fixture_root
from tests.harmony_fixture import gpt_oss_tiny_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PREFIXGATE_LLAMA_CPP_CONVERTER") != "1",
        reason="runs llama.cpp's converter: PREFIXGATE_LLAMA_CPP_CONVERTER=1",
    ),
]


def _convert(tmp: Path) -> None:
    tool = llama_cpp_converter()
    subprocess.run(
        [sys.executable, str(tool / "convert_hf_to_gguf.py"), str(gpt_oss_tiny_dir()),
         "--outfile", str(tmp / "gpt-oss-tiny.gguf"), "--outtype", "f32"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tool / "gguf-py")},
    )  # fmt: skip


def test_the_converters_gguf_loads_to_the_same_model():
    gguf = load_model(_build_once(fixture_root() / "gpt-oss-tiny-gguf-v1", _convert)
                      / "gpt-oss-tiny.gguf")
    hf = load_model(gpt_oss_tiny_dir())
    ignored = {"architecture", "name", "rms_norm_eps"}  # spelling, float32 metadata
    fields = [{k: v for k, v in dataclasses.asdict(c).items() if k not in ignored}
              for c in (gguf.config, hf.config)]
    assert fields[0] == fields[1]
    chat = [{"role": "user", "content": "Weather in Paris? Answer in 3 words."}]
    ids = hf.tokenizer.apply_chat_template(chat)
    assert gguf.tokenizer.apply_chat_template(chat) == ids
    assert gguf.tokenizer.eos_token_ids == hf.tokenizer.eos_token_ids
    runner = ModelRunner.from_loaded(gguf, num_pages=64, page_size=16, device="cpu",
                                     dtype="fp32")
    ours = runner.execute([SeqChunk(ids, 0, list(range(-(-len(ids) // 16))), True)])[0]
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(str(gpt_oss_tiny_dir()), dtype=torch.float32)
    with torch.inference_mode():
        reference = oracle.eval()(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - reference).abs().max().item() < PREFILL_ATOL
