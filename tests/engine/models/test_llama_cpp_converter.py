"""GGUFs written by llama.cpp's own converter load to the model transformers runs.

The family fixtures' GGUFs are written by tests/family_gguf.py to llama.cpp's conventions;
this checks those conventions against the converter itself: ``convert_hf_to_gguf.py`` (with
its ``conversion/`` package and ``gguf-py``) from the same llama-cpp-python sdist, run on the
fixture's HF directory. Opt-in (``PREFIXGATE_LLAMA_CPP_CONVERTER=1``): the converter takes
seconds per family and the sdist download once.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from prefixgate.engine.loader import load_model
from prefixgate.engine.models import family_for
from prefixgate.engine.runner import SeqChunk
from tests.engine.models.conftest import make_runner
from tests.engine.test_fidelity import PREFILL_ATOL, Pages
from tests.family_fixtures import (
    LLAMA_CPP_PYTHON,
    _build_once,
    download_sdist,
    family_fixture,
    fixture_root,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PREFIXGATE_LLAMA_CPP_CONVERTER") != "1",
        reason="runs llama.cpp's converter: PREFIXGATE_LLAMA_CPP_CONVERTER=1",
    ),
]

_VENDOR = "vendor/llama.cpp/"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _extract_converter(tmp: Path) -> None:
    download = tmp / "sdist"
    archive = download_sdist(download)
    with tarfile.open(archive) as tar:
        for member in tar:
            rel = member.name.split(_VENDOR, 1)[1] if _VENDOR in member.name else ""
            if not member.isfile() or not rel.startswith(_PARTS):
                continue
            source = tar.extractfile(member)
            assert source is not None
            dest = tmp / "llama.cpp" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(source.read())
    shutil.rmtree(download)


def llama_cpp_converter() -> Path:
    """The sdist's llama.cpp folder with its converter (cached beside the fixtures)."""
    name = "llama-cpp-converter-" + LLAMA_CPP_PYTHON.split("==")[1]
    return _build_once(fixture_root() / name, _extract_converter) / "llama.cpp"


def _convert(name: str, tmp_path: Path) -> Path:
    source = tmp_path / "hf"
    source.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(family_fixture(name).hf_dir / file, source / file)
    # NOTE: the converter refuses the llama-bpe tokenizer.json transformers writes from a vocab
    # GGUF (it adds a token past vocab_size), so every directory carries the Granite fixture's
    # (StarCoder) tokenizer: what this checks is the weights and the config
    for file in family_fixture("granite").hf_dir.glob("tokenizer*"):
        shutil.copy(file, source / file.name)
    out = tmp_path / f"{name}.gguf"
    tool = llama_cpp_converter()
    subprocess.run(
        [sys.executable, str(tool / "convert_hf_to_gguf.py"), str(source), "--outfile", str(out),
         "--outtype", "f32"],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(tool / "gguf-py")},
    )  # fmt: skip
    return out


@pytest.mark.parametrize("name", ["smollm3", "granite", "olmo2", "olmo3"])
def test_the_converters_gguf_loads_to_the_same_model(name, tmp_path):
    converted = load_model(_convert(name, tmp_path))
    fixture = family_fixture(name)
    # float32 / metadata spellings; llama.cpp writes OLMo 3 as olmo2 (the same family)
    ignored = {"name", "rms_norm_eps", "max_position_embeddings", "architecture"}
    assert family_for(converted.config.architecture).name == family_for(name).name
    hf_fields, gguf_fields = (
        {k: v for k, v in dataclasses.asdict(config).items() if k not in ignored}
        for config in (load_model(fixture.hf_dir).config, converted.config)
    )
    assert gguf_fields == hf_fields
    ids = list(range(300, 360))
    runner = make_runner(converted)
    ours = runner.execute([SeqChunk(ids, 0, Pages(runner).take(len(ids)), True)])[0]
    with torch.inference_mode():
        reference = fixture.hf_model()(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - reference).abs().max().item() < PREFILL_ATOL
