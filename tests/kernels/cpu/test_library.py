"""Building the native CPU library (kernels/cpu/library.py): processes that start together
compile it once (the others wait for that build), a build has a timeout that a loaded 2-core
machine never reaches, and a build that fails or times out says why, loudly."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixgate.kernels.cpu import library as native_lib

REPO = Path(__file__).resolve().parents[3]


def compiler_wrapper(tmp_path: Path, sleep_s: float) -> tuple[Path, Path]:
    """A ``cc`` that logs each compile (-c) to a file, sleeps, then runs the real compiler."""
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("SKIPPED LOUDLY: no C compiler (cc/gcc) on PATH")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "slow-cc"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -c "*) echo "$$ $*" >> {log}; sleep {sleep_s};; esac
        exec {real} "$@"
        """))
    wrapper.chmod(0o755)
    return wrapper, log


def tiny_sources(tmp_path: Path) -> Path:
    """A two-file library standing in for csrc/ (the real one takes ~40 s of CPU)."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "one.c").write_text("int pg_one(void) { return 1; }\n")
    (sources / "two.c").write_text("int pg_two(void) { return 2; }\n")
    return sources


# library.py alone (stdlib only): importing the kernels package would load torch, 10+ s here
BUILD = textwrap.dedent(f"""
    import importlib.util, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("library", {str(native_lib.__file__)!r})
    library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(library)
    library.SOURCE_DIR = Path(sys.argv[1])
    print(library._build(sys.argv[2]))
""")


def test_processes_that_start_together_compile_once(tmp_path):
    """Test workers and replicas start at the same time on a fresh machine: one builds, the
    others wait for it (on 2 cores, N parallel builds of the real library took N x 37 s)."""
    wrapper, log = compiler_wrapper(tmp_path, sleep_s=2)
    sources = tiny_sources(tmp_path)
    env = {**os.environ, "PREFIXGATE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}
    builds = [subprocess.Popen([sys.executable, "-c", BUILD, str(sources), str(wrapper)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    outputs = [b.communicate(timeout=300) for b in builds]
    assert all(b.returncode == 0 for b in builds), [err[-2000:] for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1  # one library, the same path
    compiled = [line.split()[-3] for line in log.read_text().splitlines()]  # "... -c SRC -o OBJ"
    assert sorted(Path(c).name for c in compiled) == ["one.c", "two.c"], log.read_text()
    assert not list((tmp_path / "cache" / "kernels").glob("tmp-*"))  # nothing half-made left


def test_a_build_that_times_out_says_why_and_warns(tmp_path, monkeypatch, caplog):
    wrapper, _ = compiler_wrapper(tmp_path, sleep_s=30)
    monkeypatch.setattr(native_lib, "SOURCE_DIR", tiny_sources(tmp_path))
    monkeypatch.setattr(native_lib, "BUILD_TIMEOUT_S", 1.0)
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    native_lib.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_lib.__name__):
            assert native_lib.library() is None
        status = native_lib.native_status()
    finally:
        monkeypatch.undo()
        native_lib.library.cache_clear()
    assert status.startswith("unavailable: build timed out") and "one.c" in status, status
    assert "1 s" in status and "load average" in status
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "timed out" in warning.getMessage() and "torch path" in warning.getMessage()


def test_a_failed_compile_names_the_source_and_the_error(tmp_path, monkeypatch):
    sources = tiny_sources(tmp_path)
    (sources / "two.c").write_text("int pg_two(void) { return missing_name; }\n")
    monkeypatch.setattr(native_lib, "SOURCE_DIR", sources)
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path / "cache"))
    native_lib.library.cache_clear()
    try:
        assert native_lib.library() is None
        status = native_lib.native_status()
    finally:
        monkeypatch.undo()
        native_lib.library.cache_clear()
    assert status.startswith("unavailable: build failed: two.c") and "missing_name" in status


def test_the_timeout_leaves_room_for_a_loaded_two_core_machine():
    """Measured on a 2-core Xeon (KVM): paged_prefill.c, the slowest source, compiled in 20 s
    at load average 0.3 and in 109 s at 5.5; these machines reach 17-25 (about 500 s by that
    rate). The old 120 s timeout made such builds fall back to the torch path. The timeout
    only has to catch a compiler that hangs."""
    assert native_lib.BUILD_TIMEOUT_S >= 2 * 500
