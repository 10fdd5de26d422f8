"""gpt-oss's MXFP4 experts from a GGUF (ggml type MXFP4, 17-byte blocks).

Always: a GGUF written with gguf-py (its own MXFP4 quantizer) reads back through the loader's
tensor reader as the same blocks (kept for gpt-oss, dequantized to gguf-py's fp32 otherwise).
Opt-in like the other converter tests (``PREFIXGATE_LLAMA_CPP_CONVERTER=1``): llama.cpp's own
converter run on the HF MXFP4 fixture (tests/mxfp4_fixture.py) gives the same blocks, byte for
byte, and the same logits and greedy tokens as the HF checkpoint (GGUF = HF).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from prefixgate.engine.loader import load_model
from prefixgate.engine.loader.gguf import _read_tensor
from prefixgate.engine.loader.gguf_reader import FastGGUFReader
from prefixgate.engine.runner import ModelRunner, SeqChunk
from prefixgate.kernels.torch_cpu.mxfp4 import Mxfp4Experts, Mxfp4Tensor
from tests.engine.test_fidelity import LAYOUT_ATOL, Pages

MXFP4 = GGMLQuantizationType.MXFP4


def test_the_reader_keeps_mxfp4_experts_in_their_blocks(tmp_path: Path):
    experts = (np.random.default_rng(0).standard_normal((3, 8, 64)) * 2).astype(np.float32)
    blocks = quantize(experts, MXFP4)  # [3, 8, 34]
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "gpt-oss")
    writer.add_tensor("blk.0.ffn_up_exps.weight", blocks, raw_dtype=MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = FastGGUFReader(tmp_path / "t.gguf").tensors
    kept = _read_tensor(tensor, (3, 8, 64), True, None, keep_mxfp4=True)
    assert isinstance(kept, Mxfp4Tensor) and kept.shape == (24, 64)
    assert np.array_equal(kept.to_gguf().numpy().reshape(3, 8, 34), blocks)
    expanded = dequantize(blocks, MXFP4)
    assert np.array_equal(kept.dequantize().numpy().reshape(3, 8, 64), expanded)
    parts = Mxfp4Experts.from_rows(kept, 3)
    assert parts.shape == (3, 8, 64)
    plain = _read_tensor(tensor, (3, 8, 64), True, None)  # another family: fp32
    assert isinstance(plain, torch.Tensor) and np.array_equal(plain.numpy(), expanded)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PREFIXGATE_LLAMA_CPP_CONVERTER") != "1",
                    reason="runs llama.cpp's converter: PREFIXGATE_LLAMA_CPP_CONVERTER=1")
def test_the_converters_mxfp4_gguf_is_the_hf_checkpoint():
    from tests.mxfp4_fixture import gpt_oss_mxfp4_dir, gpt_oss_mxfp4_gguf

    gguf, hf = load_model(gpt_oss_mxfp4_gguf()), load_model(gpt_oss_mxfp4_dir())
    for name, weight in hf.weights.items():
        if isinstance(weight, Mxfp4Experts):
            theirs = gguf.weights[name]
            assert isinstance(theirs, Mxfp4Experts)
            for ours, other in zip(weight, theirs, strict=True):
                assert torch.equal(ours.nibbles, other.nibbles)
                assert torch.equal(ours.scales, other.scales)
    chat = [{"role": "user", "content": "Weather in Paris? Answer in 3 words."}]
    ids = hf.tokenizer.apply_chat_template(chat)
    assert gguf.tokenizer.apply_chat_template(chat) == ids
    outputs = []
    for loaded in (hf, gguf):
        runner = ModelRunner.from_loaded(loaded, num_pages=64, page_size=16, device="cpu",
                                         dtype="fp32")
        table = Pages(runner).take(len(ids) + 8)
        logits = runner.execute([SeqChunk(ids, 0, table, True)])[0]
        tokens = [int(logits.argmax())]
        for step in range(7):
            row = SeqChunk([tokens[-1]], len(ids) + step, table, True)
            tokens.append(int(runner.execute([row])[0].argmax()))
        outputs.append((logits, tokens))
    assert (outputs[0][0] - outputs[1][0]).abs().max().item() < LAYOUT_ATOL
    assert outputs[0][1] == outputs[1][1]
