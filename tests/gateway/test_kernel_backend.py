"""Which kernels serve, said where a user looks: ``/v1/models`` names the backend on each model
entry (``native-cpu``, ``torch-cpu``, ``triton``) with the reason when the native CPU kernels
could not be used, and a server on such a fallback warns at start-up with that reason."""

from __future__ import annotations

import logging

import httpx
import pytest

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kernel_report import engine_kernel_report, kernel_report
from prefixgate.engine.runner import ModelRunner
from prefixgate.gateway.server import ServerSettings
from prefixgate.kernels.cpu import library as native_lib
from tests.live_gateway import live_servers

pytestmark = pytest.mark.slow


def test_models_name_the_kernel_backend(client, engine):
    [card] = client.get("/v1/models").json()["data"]
    if engine.device.startswith("cuda"):
        assert card["kernel_backend"] == "triton" and card["kernel_fallback_reason"] is None
    elif native_lib.library() is not None:
        assert card["kernel_backend"] == "native-cpu" and card["kernel_fallback_reason"] is None
    else:  # no compiler here: the fallback and its reason show
        assert card["kernel_backend"] == "torch-cpu"
        assert card["kernel_fallback_reason"] == native_lib.native_status()


def test_a_library_that_did_not_build_is_reported_and_warned_about(
        loaded_model, monkeypatch, tmp_path, caplog):
    """The build failing (here: no such compiler; on a loaded machine once: a timeout) leaves
    the torch path serving: /v1/models says so and why, and the server warns when ready."""
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native_lib.library.cache_clear()
    try:
        from prefixgate.engine.async_engine import build_engine

        engine = build_engine(EngineConfig(num_pages=32, page_size=16, device="cpu"),
                              loaded=loaded_model)
        settings = ServerSettings(host="127.0.0.1", port=0, log_level="warning")
        with caplog.at_level(logging.WARNING, logger="prefixgate.server"), \
                live_servers(engine, [settings]) as [server]:
            [card] = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    finally:
        monkeypatch.undo()
        native_lib.library.cache_clear()
    assert card["kernel_backend"] == "torch-cpu"
    reason = card["kernel_fallback_reason"]
    assert reason.startswith("unavailable:") and "no-such-cc" in reason
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "prefixgate.server" and r.levelno == logging.WARNING]
    assert any(reason in w and "torch" in w for w in warnings), warnings


def test_native_kernels_turned_off_are_reported_without_a_warning(loaded_model):
    runner = ModelRunner.from_loaded(loaded_model, num_pages=8, page_size=16, device="cpu",
                                     native_kernels=False)
    report = kernel_report(runner)
    assert report.backend == "torch-cpu"
    assert report.fallback_reason == "turned off (--native-kernels off)"
    assert not report.degraded
    assert engine_kernel_report(object()) is None  # a stand-in engine (tests) says nothing
