"""Backend choice: argument > env PREFIXGATE_KERNEL_BACKEND > auto; triton stays optional."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prefixgate import kernels
from prefixgate.kernels import dispatch
from tests.kernels.paged_case import DEVICES, TOLERANCES, make_paged_batch

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_auto_picks_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert kernels.backend_name("cpu") == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert kernels.backend_name("cuda") == "triton"


def test_env_and_argument_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
    assert kernels.backend_name("cuda") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.backend_name("cpu", backend="triton") == "triton"  # argument beats env
    monkeypatch.setenv(dispatch.BACKEND_ENV, " Triton ")
    assert kernels.backend_name("cpu") == "triton"


def test_unknown_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda-graphs")
    with pytest.raises(ValueError, match=r"unknown kernel backend 'cuda-graphs' \(from env"):
        kernels.backend_name("cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA, or TRITON_INTERPRET=1"):
        kernels.backend_name("cpu", backend="triton")


def test_choice_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="prefixgate.kernels.dispatch"):
        for _ in range(3):
            kernels.backend_name("cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "kernels on cpu use the torch backend (auto)"
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_ops_agree_across_backends(device: str) -> None:
    """The public ops give the same answer on both backends (Triton interpreted on CPU)."""
    pytest.importorskip("triton")
    batch = make_paged_batch([30, 45], [1, 9], group_size=2, device=device, seed=1)
    results = {}
    for backend in ("torch", "triton"):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        key = torch.ones(2, *k_cache.shape[2:], device=device)
        slots = torch.tensor([int(batch.block_tables[0, 0]) * 16 + 3, -1], device=device)
        kernels.write_kv(key, -key, k_cache, v_cache, slots, backend=backend)
        pool = torch.stack([torch.stack([k_cache, v_cache])])  # [1, 2, P, ps, Hkv, D]
        src = batch.block_tables[0, :1].long()
        dst = torch.tensor([pool.shape[2] - 1], device=device)  # a spare page
        kernels.copy_pages(pool, src, dst, backend=backend)
        out = kernels.paged_attention(
            batch.query, pool[0, 0], pool[0, 1], *batch.args()[3:], backend=backend
        )
        results[backend] = (pool, out)
    assert torch.equal(results["torch"][0], results["triton"][0])
    torch.testing.assert_close(
        results["triton"][1], results["torch"][1], **TOLERANCES[torch.float32]
    )


def test_import_and_cpu_ops_without_triton() -> None:
    """`import kernels` and the CPU path must not need triton (an optional extra)."""
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from prefixgate import kernels
        from prefixgate.kernels import dispatch
        assert kernels.backend_name("cpu") == "torch"
        assert kernels.backend_name("cuda") == "torch"  # auto falls back
        try:
            kernels.backend_name("cpu", backend="triton")
        except RuntimeError as exc:
            assert "triton is not installed" in str(exc), exc
        else:
            raise AssertionError("asking for triton without it must fail")
        q = torch.randn(1, 2, 16)
        cache = torch.randn(2, 16, 2, 16)
        out = kernels.paged_attention(
            q, cache, cache, torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.25)
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert not any(name.startswith("triton") and sys.modules[name] is not None
                       for name in sys.modules)
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
