"""Every kernel compiles for sm_90 (H100/H200) even on a CPU-only machine, without spills.

The interpreter runs the kernels' arithmetic but not Triton's GPU pipeline, so a kernel can
pass every CPU test and still fail to compile (or spill registers) on the GPU. This compiles
the production configuration with the real pipeline, in a subprocess without the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

REPO_ROOT = Path(__file__).resolve().parents[3]
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"


def _compile_report(*args: str) -> dict:
    if not PTXAS.exists():
        pytest.skip(f"no ptxas in the triton package ({PTXAS})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 deprecation warning
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton.sm90_compile", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sm90_report() -> dict:
    return _compile_report()


def test_all_kernels_compile(sm90_report: dict) -> None:
    assert set(sm90_report) == {
        "write_kv", "decode_split", "decode_single", "decode_reduce", "prefill", "prefill_short",
        "copy_pages",
    }  # fmt: skip


def test_no_register_spills(sm90_report: dict) -> None:
    for name, report in sm90_report.items():
        if "spill_stack" in report:
            assert report["spill_stack"] == 0, f"{name} spills: {report}"


def test_attention_loads_are_pipelined(sm90_report: dict) -> None:
    """K/V tiles stream through cp.async (software-pipelined loop), not plain loads."""
    for name in ("decode_split", "decode_single", "prefill", "prefill_short"):
        assert sm90_report[name]["ptx_cp_async"] > 0, f"{name}: {sm90_report[name]}"


def test_sliding_window_variants_and_the_moe_gemm_compile_without_spills() -> None:
    report = _compile_report("--variants")
    assert set(report) == {"decode_split", "decode_reduce", "prefill", "moe_gemm"}
    for name, kernel in report.items():
        assert kernel.get("spill_stack", 0) == 0, f"{name} spills: {kernel}"
    for name in ("decode_split", "prefill"):  # the window keeps the K/V stream pipelined
        assert report[name]["ptx_cp_async"] > 0, f"windowed {name}: {report[name]}"
