"""Qwen3.5 hybrids from GGUF files written as llama.cpp's converter writes ``qwen35`` /
``qwen35moe`` (tests/family_gguf.py): the same model as from the HF directory.

The converter stores every norm but the DeltaNet's output norm as ``1 + w``, ``A_log`` as
``-exp(A_log)``, the conv as ``[C, K]``, and tiles the V heads (the fixtures have 2 K heads
for 4 V heads); the loader undoes all of it. Q8_0 files keep their matrices in blocks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from prefixgate.engine.loader import load_gguf, load_model
from prefixgate.engine.loader.gguf_reader import FastGGUFReader
from prefixgate.engine.models import family_for
from prefixgate.engine.models.moe import StackedExperts
from prefixgate.engine.models.qwen3_5 import QWEN3_5, _columns
from prefixgate.engine.runner import ZERO_STATE
from prefixgate.kernels.cpu.ops import quant_native_available
from prefixgate.kernels.quant import QuantizedTensor
from tests.engine.models.conftest import make_runner
from tests.engine.models.test_qwen3_5 import HYBRIDS, Slots, _chunk, _oracle_logits, _prompt
from tests.engine.test_fidelity import LAYOUT_ATOL, PREFILL_ATOL, Pages
from tests.family_fixtures import quantized_gguf

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
# the converter's float32 round trips: (1 + w) - 1 and log(-(-exp(a))), within an ulp
_ROUND_TRIPPED = ("norm.weight", "A_log")


def _greedy(runner, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    table, slot = Pages(runner, seed=3).take(len(prompt) + NEW_TOKENS), Slots().take()
    first = runner.execute([_chunk(prompt, 0, table, slot, restore=ZERO_STATE)])[0]
    tokens = [int(first.argmax())]
    for step in range(NEW_TOKENS - 1):
        logits = runner.execute([_chunk([tokens[-1]], len(prompt) + step, table, slot)])[0]
        tokens.append(int(logits.argmax()))
    return first, tokens


@pytest.mark.parametrize("name", HYBRIDS)
def test_gguf_loads_to_the_hf_model(family_case, name):
    case = family_case(name)
    gguf = load_model(case.fixture.gguf_path)
    assert family_for(gguf.config.architecture) is QWEN3_5
    ignored = {"architecture", "name", "rms_norm_eps"}  # the file's eps is float32
    hf_fields = {
        k: v for k, v in dataclasses.asdict(case.loaded.config).items() if k not in ignored
    }
    assert {
        k: v for k, v in dataclasses.asdict(gguf.config).items() if k not in ignored
    } == hf_fields
    # every converter transform undone (V heads back in HF's grouped order, q|gate rows split)
    assert sorted(gguf.weights) == sorted(case.loaded.weights)
    for key, want in case.loaded.weights.items():
        got = gguf.weights[key]
        if key.endswith(_ROUND_TRIPPED):
            torch.testing.assert_close(got, want, rtol=2.4e-7, atol=6e-8, msg=key)
        else:
            assert torch.equal(got, want), key
    # the real tokenizer travels in the file, with Qwen3.5's own pre-tokenizer (\p{M} joins
    # letters: the GPT-2 split differs on this Hindi)
    for text in ("हिन्दी में नमस्ते", "It's 12345 don'T\n\n  x"):
        assert gguf.tokenizer.encode(text) == case.loaded.tokenizer.encode(text)
    chat = [{"role": "user", "content": "Hi there"}]
    assert gguf.tokenizer.apply_chat_template(chat) == case.loaded.tokenizer.apply_chat_template(
        chat
    )
    # the runner on the GGUF: transformers' logits, and greedy identical to the HF-loaded runner
    prompt = _prompt(case)
    first, tokens = _greedy(make_runner(gguf), prompt)
    hf_first, hf_tokens = _greedy(case.runner, prompt)
    assert (first - _oracle_logits(case.oracle, prompt)[-1]).abs().max().item() < PREFILL_ATOL
    assert (first - hf_first).abs().max().item() < PREFILL_ATOL
    assert tokens == hf_tokens


@pytest.mark.parametrize("name", HYBRIDS)
def test_q8_0_gguf_computes_in_its_blocks_like_dequantized(name):
    loaded = load_gguf(quantized_gguf(name, "Q8_0"))
    layer = loaded.config.linear_attention.layers.index(True)
    weights = loaded.weights
    prefix = f"model.layers.{layer}.linear_attn."
    # row gathers (V heads, q|gate) and the 16-wide V-head column order of out_proj: the rows
    # stay blocks; out_proj's heads are narrower than a block, so it is dequantized
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
        assert isinstance(weights[prefix + f"{part}.weight"], QuantizedTensor), part
    assert isinstance(weights["model.layers.3.self_attn.gate_proj.weight"], QuantizedTensor)
    assert not isinstance(weights[prefix + "out_proj.weight"], QuantizedTensor)
    dense_weights = {
        key: value.dequantize() if isinstance(value, QuantizedTensor | StackedExperts) else value
        for key, value in weights.items()
    }
    blocks, dense = (
        make_runner(loaded),
        make_runner(dataclasses.replace(loaded, weights=dense_weights)),
    )
    if quant_native_available():
        assert blocks.model.layers[layer].proj.quant == "Q8_0"
        assert blocks.model.layers[3].qkvg.quant == "Q8_0"
    assert dense.model.layers[layer].proj.quant is None
    ids = list(range(200, 245))
    ours, reference = (
        runner.execute([_chunk(ids, 0, [0, 1, 2], 0, restore=ZERO_STATE)])[0]
        for runner in (blocks, dense)
    )
    assert (ours - reference).abs().max().item() < LAYOUT_ATOL


def test_q8_0_gguf_through_the_engine_hits_and_decodes_like_a_cold_engine():
    # the file's tokenizer and template, its matrices in blocks, the state cache
    from tests.engine.models.test_qwen3_5_engine import _cached, _engine

    loaded = load_gguf(quantized_gguf("qwen3_5", "Q8_0"))
    base = list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    shared = (base * 8)[:40]
    warm = _engine(loaded)
    _cached(warm, shared + [11, 12, 13], "first")
    hit, decoded = _cached(warm, shared + [21, 22, 23], "second")
    assert hit == 32
    cold = _engine(loaded, enable_prefix_caching=False)
    assert _cached(cold, shared + [21, 22, 23], "cold")[1] == decoded


def test_columns_moves_whole_blocks_or_dequantizes():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(0)
    matrix = torch.randn(6, 128)
    data = torch.from_numpy(quantize(matrix.numpy(), GGMLQuantizationType.Q8_0).copy())
    blocks = QuantizedTensor("Q8_0", data, (6, 128))
    heads = torch.arange(128).reshape(2, 2, 32).transpose(0, 1).reshape(-1)  # 32-wide heads
    moved = _columns(blocks, heads)
    assert isinstance(moved, QuantizedTensor)
    assert torch.equal(moved.dequantize(), blocks.dequantize()[:, heads])
    narrow = torch.arange(128).reshape(4, 2, 16).transpose(0, 1).reshape(-1)  # 16-wide heads
    assert torch.equal(_columns(blocks, narrow), blocks.dequantize()[:, narrow])


def _rewrite_as_other_converters(source, target) -> None:
    """``source`` as other llama.cpp conversions write it: an MTP block after the trunk
    (``block_count`` + 1, ``nextn_predict_layers``: what the converter exports unless
    ``--no-mtp``), ``--fuse-qkv`` (the full layer's q|gate, k, v in one ``attn_qkv``),
    ``--fuse-gate-up-exps``, and no ``recurrent_layers`` key (older files: the interval)."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    reader = FastGGUFReader(source)  # (gguf-py's own parses the 150k-token vocab for ~30 s)
    arch = reader.value("general.architecture")
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in (
            "general.architecture",
            f"{arch}.attention.recurrent_layers",
        ):
            continue
        main = field.types[0]
        value = reader.value(key)
        if key == f"{arch}.block_count":
            value += 1
        writer.add_key_value(
            key, value, main, field.types[-1] if main == GGUFValueType.ARRAY else None
        )
    writer.add_nextn_predict_layers(1)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    full = 3  # the fixtures' full-attention layer
    q, k, v = (tensors.pop(f"blk.{full}.attn_{p}.weight") for p in "qkv")
    tensors[f"blk.{full}.attn_qkv.weight"] = (np.concatenate([q[0], k[0], v[0]]), q[1])
    for layer in range(4):
        gate, up = (tensors.pop(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up"))
        tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = (
            np.concatenate([gate[0], up[0]], 1),
            gate[1],
        )
    for name in [n for n in tensors if n.startswith(f"blk.{full}.")]:  # the MTP block: a full layer
        tensors[name.replace(f"blk.{full}.", "blk.4.")] = tensors[name]
    hidden = tensors["output_norm.weight"][0].shape[0]
    for part, shape in (
        ("eh_proj", (hidden, 2 * hidden)),
        ("enorm", (hidden,)),
        ("hnorm", (hidden,)),
    ):
        tensors[f"blk.4.nextn.{part}.weight"] = (np.ones(shape, np.float32), None)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])  # Q8_0: fused tensors split as rows of blocks
def test_gguf_with_mtp_fused_qkv_and_gate_up_loads_the_same(tmp_path, qtype):
    from tests.family_fixtures import family_fixture

    source = (
        family_fixture("qwen3_5_moe").gguf_path if qtype == "F32" else quantized_gguf("qwen3_5_moe")
    )
    _rewrite_as_other_converters(source, tmp_path / "other.gguf")
    plain, other = load_gguf(source), load_gguf(tmp_path / "other.gguf")
    assert other.config == plain.config
    assert sorted(other.weights) == sorted(plain.weights)  # the MTP block dropped
    for key, want in plain.weights.items():
        got = other.weights[key]
        if isinstance(want, StackedExperts):
            assert all(
                torch.equal(a.data, b.data) for a, b in zip(got.parts, want.parts, strict=True)
            ), key
        elif isinstance(want, QuantizedTensor):
            assert torch.equal(got.data, want.data), key
        else:
            assert torch.equal(got, want), key


@pytest.mark.skipif(
    os.environ.get("PREFIXGATE_LLAMA_CPP_CONVERTER") != "1",
    reason="runs llama.cpp's converter: PREFIXGATE_LLAMA_CPP_CONVERTER=1",
)
@pytest.mark.parametrize("name", HYBRIDS)
def test_the_converters_gguf_is_the_fixtures(name, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (the sdist's; ``--no-mtp``: the tiny models have
    no MTP block) on the fixture's HF directory writes the fixture's tensors, bit for bit, and
    its keys."""
    import shutil
    import subprocess
    import sys

    import numpy as np

    from tests.engine.models.test_llama_cpp_converter import llama_cpp_converter
    from tests.family_fixtures import family_fixture

    fixture = family_fixture(name)
    source = tmp_path / "hf"
    source.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(fixture.hf_dir / file, source / file)
    # the converter refuses the tokenizer.json transformers writes from a vocab GGUF (see
    # test_llama_cpp_converter.py): the weights and the config are what this checks
    for file in family_fixture("granite").hf_dir.glob("tokenizer*"):
        shutil.copy(file, source / file.name)
    out, tool = tmp_path / "converted.gguf", llama_cpp_converter()
    subprocess.run(
        [sys.executable, str(tool / "convert_hf_to_gguf.py"), str(source), "--outfile", str(out),
         "--outtype", "f32", "--no-mtp"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tool / "gguf-py")},
    )  # fmt: skip
    theirs, ours = FastGGUFReader(out), FastGGUFReader(fixture.gguf_path)
    assert sorted(t.name for t in theirs.tensors) == sorted(t.name for t in ours.tensors)
    by_name = {t.name: t for t in ours.tensors}
    for tensor in theirs.tensors:
        mine = by_name[tensor.name]
        assert (tensor.tensor_type, list(tensor.shape)) == (mine.tensor_type, list(mine.shape))
        assert np.array_equal(np.array(tensor.data), np.array(mine.data)), tensor.name
    arch = theirs.value("general.architecture")
    keys = [k for k in theirs.fields if k.startswith(f"{arch}.")]
    assert {k: theirs.value(k) for k in keys} == {k: ours.value(k) for k in keys}
