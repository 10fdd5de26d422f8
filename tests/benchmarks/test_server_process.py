"""benchmarks.server_process: a server subprocess is ready when /v1/models answers, and stop()
leaves nothing of its process group behind (vLLM's workers outlive a SIGTERM to the PID)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import textwrap

import pytest

from benchmarks.common import free_port
from benchmarks.server_process import ServerProcess, memory_mb

SERVER = textwrap.dedent("""
    import http.server, json, subprocess, sys
    # a child that ignores SIGTERM, like a worker left behind
    subprocess.Popen([sys.executable, "-c",
                      "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "toy"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
        def log_message(self, *args): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_ready_measured_and_stopped_with_its_whole_group(monkeypatch):
    import benchmarks.server_process as module

    monkeypatch.setattr(module, "STOP_TIMEOUT_S", 1)
    port = free_port()
    server = ServerProcess("toy", [sys.executable, "-c", SERVER, str(port)], port)
    try:
        seconds, ids = server.wait_ready(30)
        assert ids == ["toy"] and seconds > 0
        memory = memory_mb(server.pid)
        assert memory["rss_tree_mb"] > memory["rss_mb"] > 0  # the child counts in the tree
    finally:
        server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)


def test_a_server_that_exits_early_reports_its_log():
    port = free_port()
    server = ServerProcess("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"], port)
    try:
        with pytest.raises(RuntimeError, match="exited with 3(.|\\n)*no model here"):
            server.wait_ready(30)
    finally:
        server.stop()


def test_stop_leaves_no_log_file_behind(tmp_path, monkeypatch):
    """A benchmark's server log is temporary: after stop() nothing of it stays in the temp
    directory, whether the server ran or died at start (its tail went into the error)."""
    import benchmarks.server_process as module

    monkeypatch.setattr(module, "STOP_TIMEOUT_S", 1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where NamedTemporaryFile writes
    port = free_port()
    for command in ([sys.executable, "-c", SERVER, str(port)],
                    [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]):
        server = ServerProcess("leftover", command, port)
        try:
            with contextlib.suppress(RuntimeError):
                server.wait_ready(30)
            assert server.log_tail() is not None  # readable while the server lives
        finally:
            server.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_kept_log_lands_where_asked(tmp_path):
    """``log_dir`` puts the log in a folder of the caller's (a test's tmp_path) and
    ``keep_log`` keeps it after stop(), to read what the server said."""
    port = free_port()
    server = ServerProcess("kept", [sys.executable, "-c", "print('said this')"], port,
                           log_dir=tmp_path, keep_log=True)
    server.process.wait(30)
    server.stop()
    [log] = tmp_path.iterdir()
    assert log.name.startswith("bench_kept_") and "said this" in log.read_text()
