"""The native CPU decode kernel (kernels/cpu/csrc/paged_decode.c) against the naive oracle."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixgate.kernels.attention_plan import plan_attention
from prefixgate.kernels.cpu import library as native_lib
from prefixgate.kernels.cpu.decode import (
    native_decode_available,
    native_status,
    paged_decode_native,
)
from prefixgate.kernels.torch_cpu import attention as reference
from prefixgate.kernels.torch_cpu.attention import paged_attention_torch
from tests.kernels.oracle import naive_paged_attention
from tests.kernels.paged_case import (
    make_paged_batch,
    make_shared_prefix_batch,
    poison_before,
)

FP32_CPU = {"atol": 2e-6, "rtol": 1e-5}
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)


def _decode_inputs(batch):
    plan = plan_attention(
        batch.block_tables.tolist(),
        batch.seq_lens.tolist(),
        batch.query_start_loc.tolist(),
        page_size=batch.k_cache.shape[1],
        kv_row_elems=batch.k_cache.shape[2] * batch.k_cache.shape[3],
        share_prefixes=False,
    )
    assert len(plan.padded) == 1 and not plan.prefill
    return plan.padded[0]


def _run(
    batch, chunk, out, *, rows=None, pages=None, lengths=None, lse=None, num_threads=None,
    window=None,
) -> bool:
    """``paged_decode_native`` on a test batch's decode chunk, with optional overrides."""
    return paged_decode_native(
        out,
        batch.query,
        batch.k_cache,
        batch.v_cache,
        chunk.rows if rows is None else rows,
        chunk.pages if pages is None else pages,
        chunk.lengths if lengths is None else lengths,
        batch.scale,
        lse,
        num_threads,
        window,
    )


def test_builds_and_loads_here() -> None:
    assert native_decode_available(), native_status()
    assert native_status().startswith("native (")


# specialised (group, head_dim) pairs of the C dispatch and generic ones (5 / 32, 96)
@pytest.mark.parametrize(
    ("group_size", "head_dim"), [(1, 64), (3, 64), (8, 128), (2, 128), (5, 32), (3, 96)]
)
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_threads", [1, 8])  # 6 sequences: per-sequence / per-head items
def test_decode_matches_naive_and_reads_only_the_context(
    group_size: int, head_dim: int, page_size: int, num_threads: int
) -> None:
    # ragged lengths incl. one token, a page boundary, one past it; NaN everywhere else
    lens = [1, 16, 17, 45, 100, 64]
    batch = make_paged_batch(
        lens,
        [1] * len(lens),
        group_size=group_size,
        head_dim=head_dim,
        page_size=page_size,
        garbage=float("nan"),
    )
    chunk = _decode_inputs(batch)
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.empty(len(lens), batch.query.shape[1])
    assert _run(batch, chunk, out, lse=lse, num_threads=num_threads)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)
    # the log-sum-exp the cascade merge relies on
    for row, ctx in enumerate(chunk.lengths.tolist()):
        s = chunk.rows[row].item()
        table = batch.block_tables[s].tolist()
        slots = [table[p // page_size] * page_size + p % page_size for p in range(ctx)]
        keys = batch.k_cache.flatten(0, 1)[slots].double()  # [ctx, Hkv, D]
        keys = keys.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,chd->hc", batch.query[s].double(), keys) * batch.scale
        torch.testing.assert_close(lse[row].double(), torch.logsumexp(scores, -1), **FP32_CPU)


@pytest.mark.parametrize("window", [1, 7, 16, 33, 1000])
@pytest.mark.parametrize(("group_size", "head_dim", "num_threads"), [(3, 64, 1), (2, 32, 8)])
def test_a_window_attends_the_last_positions_and_reads_nothing_before(
    window: int, group_size: int, head_dim: int, num_threads: int
) -> None:
    """A sliding layer: rows of different lengths, some inside the window, some past it (one
    on a page boundary); every position before a row's window is NaN, so a read poisons it.
    Per-sequence items (1 thread) and per-head items (8)."""
    lens = [1, 16, 17, 45, 100, 64]
    batch = make_paged_batch(lens, [1] * len(lens), group_size=group_size, head_dim=head_dim,
                             seed=window, garbage=float("nan"))
    expected = naive_paged_attention(batch, window)
    poison_before(batch, [n - window for n in lens])
    chunk = _decode_inputs(batch)
    out = torch.full_like(batch.query, float("nan"))
    assert _run(batch, chunk, out, num_threads=num_threads, window=window)
    torch.testing.assert_close(out.double(), expected, **FP32_CPU)
    bf16 = _bf16_pages(batch)  # bf16 pages take the same walk
    assert _run(bf16, chunk, out, num_threads=num_threads, window=window)
    torch.testing.assert_close(out.double(), naive_paged_attention(bf16, window), **FP32_CPU)
    with pytest.raises(ValueError, match="window must be positive"):
        _run(batch, chunk, out, window=0)


def _bf16_pages(batch):
    """The batch with its pages rounded to bf16 as ``--kv-dtype bf16`` stores them; the query
    stays fp32."""
    return dataclasses.replace(
        batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16()
    )


@pytest.mark.parametrize(("group_size", "head_dim"), [(1, 64), (3, 64), (8, 128), (5, 32)])
@pytest.mark.parametrize("num_threads", [1, 8])  # per-sequence / per-head items
def test_bf16_pages_match_the_torch_path_on_the_same_pages(
    group_size: int, head_dim: int, num_threads: int
) -> None:
    """bf16 pages are widened exactly on load: the kernel gives what it gives on the same
    values in fp32 pages (up to the vectoriser's summation order), and the torch path's result
    reading the same bf16 pages."""
    lens = [1, 16, 17, 45, 100, 64]
    batch = _bf16_pages(
        make_paged_batch(lens, [1] * len(lens), group_size=group_size, head_dim=head_dim)
    )
    chunk = _decode_inputs(batch)
    out, lse = torch.full_like(batch.query, float("nan")), torch.empty(len(lens), batch.query.shape[1])
    assert _run(batch, chunk, out, lse=lse, num_threads=num_threads)
    widened = dataclasses.replace(batch, k_cache=batch.k_cache.float(), v_cache=batch.v_cache.float())
    out32, lse32 = torch.full_like(out, float("nan")), torch.empty_like(lse)
    assert _run(widened, chunk, out32, lse=lse32, num_threads=num_threads)
    torch.testing.assert_close(out, out32, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse32, atol=1e-6, rtol=1e-6)
    torch_plan = plan_attention(
        batch.block_tables.tolist(), lens, batch.query_start_loc.tolist(),
        page_size=16, kv_row_elems=batch.k_cache[0, 0].numel(), use_native=False,
    )
    torch_path = paged_attention_torch(*batch.args(), plan=torch_plan)
    assert torch_path.dtype == torch.float32
    torch.testing.assert_close(out, torch_path, **FP32_CPU)
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


def test_bf16_shared_prefix_decode_agrees_with_the_torch_path() -> None:
    batch = _bf16_pages(make_shared_prefix_batch(40, [5, 16, 1, 23], group_size=3, seed=3))
    native = paged_attention_torch(*batch.args())
    torch_plan = plan_attention(
        batch.block_tables.tolist(), batch.seq_lens.tolist(), batch.query_start_loc.tolist(),
        page_size=16, kv_row_elems=batch.k_cache[0, 0].numel(), use_native=False,
    )
    torch.testing.assert_close(native, paged_attention_torch(*batch.args(), plan=torch_plan), **FP32_CPU)
    torch.testing.assert_close(native.double(), naive_paged_attention(batch), **FP32_CPU)


def test_reference_uses_it_and_agrees_with_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_paged_batch([33, 80, 7, 129], [1, 1, 1, 1], group_size=3, seed=2)
    calls = []
    real = reference.paged_decode_native
    monkeypatch.setattr(
        reference, "paged_decode_native", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    with_native = paged_attention_torch(*batch.args())
    assert calls
    monkeypatch.setattr(reference, "paged_decode_native", lambda *a, **k: False)
    torch_only = paged_attention_torch(*batch.args())
    torch.testing.assert_close(with_native, torch_only, **FP32_CPU)


def test_shared_prefix_suffixes_go_native() -> None:
    batch = make_shared_prefix_batch(40, [5, 16, 1, 23], group_size=3, seed=3)
    out = paged_attention_torch(*batch.args())
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


def test_declines_what_it_does_not_handle() -> None:
    batch = make_paged_batch([20, 9], [1, 1], group_size=2, dtype=torch.bfloat16)
    chunk = _decode_inputs(batch)
    out = torch.zeros_like(batch.query)
    args = (batch.k_cache, batch.v_cache, chunk.rows, chunk.pages, chunk.lengths, batch.scale)
    assert not paged_decode_native(out, batch.query, *args)  # bf16 query
    fp16 = make_paged_batch([20, 9], [1, 1], group_size=2, dtype=torch.float16)
    args16 = (fp16.k_cache, fp16.v_cache, chunk.rows, chunk.pages, chunk.lengths, fp16.scale)
    assert not paged_decode_native(torch.zeros(2, 4, 32), fp16.query.float(), *args16)  # fp16 pages
    fp32 = make_paged_batch([20, 9], [1, 1], group_size=2)
    chunk = _decode_inputs(fp32)
    strided = fp32.query.transpose(1, 2).contiguous().transpose(1, 2)  # head dim not dense
    out = torch.zeros_like(fp32.query)
    args = (fp32.k_cache, fp32.v_cache, chunk.rows, chunk.pages, chunk.lengths, fp32.scale)
    assert not paged_decode_native(out, strided, *args)
    assert not paged_decode_native(out, fp32.query, *args[:3], chunk.pages.int(), *args[4:])
    assert out.abs().sum() == 0  # nothing written when declined


def test_no_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native_lib.library.cache_clear()
    try:
        assert not native_decode_available()
        assert native_status().startswith("unavailable")
        batch = make_paged_batch([20, 9], [1, 1], group_size=2)
        torch.testing.assert_close(
            paged_attention_torch(*batch.args()).double(), naive_paged_attention(batch), **FP32_CPU
        )
    finally:
        monkeypatch.undo()
        native_lib.library.cache_clear()
    assert native_decode_available()


@pytest.mark.parametrize("num_threads", [1, 8])
def test_bad_addressing_is_an_error_not_a_stray_read(num_threads: int) -> None:
    batch = make_paged_batch([40, 20, 9, 33], [1, 1, 1, 1], group_size=2, seed=4)
    chunk = _decode_inputs(batch)
    num_pages = batch.k_cache.shape[0]
    out = torch.zeros_like(batch.query)
    for bad_page in (num_pages, -1, 1 << 40):
        pages = chunk.pages.clone()
        pages[1, 0] = bad_page
        with pytest.raises(ValueError, match="outside the pool"):
            _run(batch, chunk, out, pages=pages, num_threads=num_threads)
    lengths = chunk.lengths.clone()
    lengths[2] = 0
    with pytest.raises(ValueError, match="length < 1"):
        _run(batch, chunk, out, lengths=lengths, num_threads=num_threads)
    for bad_row in (batch.query.shape[0], -1):
        rows = chunk.rows.clone()
        rows[3] = bad_row
        with pytest.raises(ValueError, match="query row outside"):
            _run(batch, chunk, out, rows=rows, num_threads=num_threads)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _run(batch, chunk, out, lengths=chunk.lengths[:2], num_threads=num_threads)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _run(batch, chunk, out, lse=torch.empty(1, 3), num_threads=num_threads)
    assert out.abs().sum() == 0  # rejected before anything was written
    # the same tensors with valid addressing go through
    assert _run(batch, chunk, out, num_threads=num_threads)


def test_query_rows_past_the_batch_are_an_error() -> None:
    batch = make_paged_batch([20, 9], [1, 1], group_size=2)
    starts = torch.tensor([1_000_000, 1_000_001, 1_000_002], dtype=torch.int32)
    args = list(batch.args())
    args[5] = starts
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_torch(*args)


def test_loading_the_library_keeps_subnormals() -> None:
    """Linking a shared object with -ffast-math would turn on flush-to-zero process-wide."""
    code = (
        "import torch\n"
        "from prefixgate.kernels.cpu.decode import native_decode_available, native_status\n"
        "assert native_decode_available(), native_status()\n"
        "assert (torch.tensor([1e-39]) * 1.0).item() != 0.0\n"
        "assert 5e-324 * 1.0 != 0.0\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_plan_without_native_uses_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_shared_prefix_batch(40, [5, 16, 3], group_size=3, seed=6)
    plan = plan_attention(
        batch.block_tables.tolist(),
        batch.seq_lens.tolist(),
        batch.query_start_loc.tolist(),
        page_size=16,
        kv_row_elems=batch.k_cache.shape[2] * batch.k_cache.shape[3],
        use_native=False,
    )
    calls = []
    monkeypatch.setattr(reference, "paged_decode_native", lambda *a, **k: calls.append(1))
    out = paged_attention_torch(*batch.args(), plan)
    assert not calls
    torch.testing.assert_close(out.double(), naive_paged_attention(batch), **FP32_CPU)


def test_cache_dir_falls_back_to_a_private_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.delenv("PREFIXGATE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the usual cache dir cannot exist
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(native_lib.tempfile, "tempdir", str(temp))
    chosen = native_lib._cache_dir()
    assert chosen.parent == temp and chosen.stat().st_mode & 0o777 == 0o700
    # a directory someone else could write into is refused (code is loaded from it)
    chosen.chmod(0o777)
    with pytest.raises(OSError, match="not a private directory"):
        native_lib._cache_dir()
