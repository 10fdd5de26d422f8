"""benchmarks.server_process: a server subprocess is ready when /v1/models answers, and stop()
leaves nothing of its process group behind (vLLM's workers outlive a SIGTERM to the PID)."""

from __future__ import annotations

import os
import sys
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
