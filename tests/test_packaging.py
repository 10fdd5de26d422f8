"""The distribution installs ONE import namespace, ``prefixgate.*``, beside the agent SDKs.

The repository folders gateway/, engine/, cache/, kernels/, agents/ become prefixgate.gateway,
prefixgate.engine, prefixgate.cache, prefixgate.kernels, prefixgate.agents; no bare top-level
name is installed, so ``import agents`` stays the OpenAI Agents SDK's and ``import kernels`` Hugging Face's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("gateway", "engine", "cache", "kernels", "agents")

# Run in a scratch directory: the working directory must not put the repository on sys.path.
# A bare name may exist only as somebody else's package (the Agents SDK's `agents`, HF's
# `kernels`), never as one of ours.
BARE_NAMES_ABSENT = textwrap.dedent(f"""
    import importlib.util
    for name in {FOLDERS!r}:
        spec = importlib.util.find_spec(name)
        origin = (spec.origin or "") if spec else ""
        ours = origin.startswith({str(REPO)!r} + "/" + name + "/") or "prefixgate" in origin
        assert spec is None or not ours, spec
    assert importlib.util.find_spec("gateway") is None and importlib.util.find_spec("cache") is None
""")


def _run(python: Path | str, script: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(python), "-c", script], cwd=cwd, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_editable_install_is_one_namespace(tmp_path: Path) -> None:
    """The development install (pip install -e) maps prefixgate.<folder> to the folders; nothing
    is importable under a folder's bare name, and each module exists once."""
    out = _run(sys.executable, BARE_NAMES_ABSENT + textwrap.dedent("""
        import prefixgate.cache, prefixgate.engine.scheduler, prefixgate.gateway.cli
        import prefixgate.kernels, prefixgate.agents.swarm
        from prefixgate.cache import KVCacheManager
        from prefixgate.engine.scheduler import KVCacheManager as used_by_engine
        assert KVCacheManager is used_by_engine
        print(prefixgate.cache.__file__)
        print(prefixgate.gateway.cli.__file__)
    """), cwd=tmp_path)
    cache_file, cli_file = out.split()
    assert Path(cache_file) == REPO / "cache" / "__init__.py"
    assert Path(cli_file) == REPO / "gateway" / "cli.py"


def test_suite_sees_the_agents_sdk_not_the_client_folder() -> None:
    """In this very process (pytest, repository root on sys.path for tests.*): a bare
    ``agents`` is the OpenAI Agents SDK, which the framework tests import."""
    import agents

    assert "prefixgate" not in (agents.__file__ or "") and Path(agents.__file__).parent != REPO / "agents"
    assert hasattr(agents, "Runner") and hasattr(agents, "function_tool")


def _build_wheel(dest: Path) -> Path:
    """Build from a copy of the files git knows (tracked, or new and not ignored): what a clean
    clone holds, and no build/ folder left in the repository."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            cwd=REPO, check=True, capture_output=True, text=True).stdout
    source = dest.parent / "source"
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--disable-pip-version-check", "-w", str(dest), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = dest.glob("prefixgate-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_installs_beside_openai_agents(tmp_path: Path) -> None:
    """Build the wheel, install it with its dependencies and the OpenAI Agents SDK into a fresh
    venv, and import both sides (and HF ``kernels`` too when it installs)."""
    wheel = _build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every source file and every piece of package data made it into the wheel
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*"):
            if "examples" in path.parts or "__pycache__" in path.parts or path.is_dir():
                continue
            if path.suffix in (".py", ".c", ".h", ".html", ".css", ".js"):
                member = "prefixgate/" + path.relative_to(REPO).as_posix()
                assert member in names, f"{member} is missing from the wheel"
    assert not any(n.split("/")[0] in FOLDERS for n in names), "a bare top-level package"
    assert "prefixgate/__init__.py" not in names  # an implicit namespace package

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch pinned to the CPU build on local disk (a bare `torch` would pull a CUDA build)
    subprocess.run([*pip, str(wheel), "openai-agents", "torch==2.13.0"], check=True,
                   capture_output=True, text=True, timeout=900)
    hf_kernels = subprocess.run([*pip, "kernels"], capture_output=True, text=True,
                                timeout=300).returncode == 0

    site = Path(_run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     tmp_path).strip())
    out = _run(python, BARE_NAMES_ABSENT + textwrap.dedent(f"""
        from importlib.resources import files
        from agents import Agent, Runner, function_tool   # the OpenAI Agents SDK
        import agents
        import prefixgate.agents.swarm, prefixgate.cache, prefixgate.gateway.cli
        from prefixgate import kernels
        assert agents.__file__.startswith({str(site)!r}) and "prefixgate" not in agents.__file__
        assert prefixgate.gateway.cli.__file__.startswith({str(site)!r})
        assert (files("prefixgate.gateway.http") / "static" / "dashboard.html").is_file()
        assert (files("prefixgate.kernels.cpu") / "csrc" / "linear.c").is_file()
        if {hf_kernels!r}:
            import kernels as hf
            assert "prefixgate" not in hf.__file__ and hf is not prefixgate.kernels
        print("ok")
    """), tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.strip().endswith("ok")
    # the console script is unchanged for users
    result = subprocess.run([str(env_dir / "bin" / "prefixgate"), "serve", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--kv-memory" in result.stdout, result.stderr
