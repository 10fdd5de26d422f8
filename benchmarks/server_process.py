"""A benchmark's server subprocess (prefixgate, or a peer from ../shared/peers/): started in
its own process group with its output in a temporary log, ready when ``/v1/models`` answers,
stopped by its PID and then its group (vLLM leaves worker processes behind), and measured
(resident memory of it and its descendants). The log is deleted when the server stops (its
tail is in any start-up error) unless the caller keeps it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

STOP_TIMEOUT_S = 30  # SIGTERM grace before the process group gets SIGKILL


def _status_kb(pid: int, field_name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def memory_mb(pid: int) -> dict[str, float | None]:
    """VmRSS and VmHWM of ``pid`` and VmRSS summed over it and its descendants, in MiB."""
    rss, hwm = _status_kb(pid, "VmRSS"), _status_kb(pid, "VmHWM")
    tree = [kb for kb in (_status_kb(p, "VmRSS") for p in [pid, *_descendants(pid)]) if kb]
    return {"rss_mb": rss / 1024 if rss else None, "rss_hwm_mb": hwm / 1024 if hwm else None,
            "rss_tree_mb": sum(tree) / 1024 if tree else None}


class ServerProcess:
    """A server subprocess in its own process group, its output in a temporary log.

    Args:
        name: a label (the log's prefix, error messages).
        command, env, cwd: what to run, how.
        port: where it listens (``base_url``).
        log_dir: where the log goes (default: the temp directory; a test passes tmp_path).
        keep_log: keep the log after :meth:`stop` (default: deleted, so runs leave nothing
            in /tmp).
    """

    def __init__(self, name: str, command: list[str], port: int,
                 env: dict[str, str] | None = None, cwd: Path | None = None, *,
                 log_dir: Path | None = None, keep_log: bool = False) -> None:
        self.name = name
        self.command = command
        self.base_url = f"http://127.0.0.1:{port}"
        self.keep_log = keep_log
        # NOTE: delete=False because the server writes to it while we read it by name
        # (log_tail); stop() deletes it
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"bench_{name}_", suffix=".log", delete=False, dir=log_dir)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float) -> tuple[float, list[str]]:
        """Block until GET /v1/models answers; returns (seconds since start, model ids)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            try:
                response = httpx.get(self.base_url + "/v1/models", timeout=5)
                if response.status_code == 200:
                    ids = [str(m["id"]) for m in response.json().get("data", [])]
                    return time.perf_counter() - self.started, ids
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /v1/models in {timeout_s:.0f} s:\n"
                           + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the PID, then to its process group (workers left behind), then SIGKILL."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # the group is next
                self.process.wait(STOP_TIMEOUT_S)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, 0)  # anything left in the group?
            except ProcessLookupError:
                break
            os.killpg(self.pid, sig)
            deadline = time.monotonic() + (STOP_TIMEOUT_S if sig == signal.SIGTERM else 5)
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        if self.process.poll() is None:
            self.process.wait(5)
        self.log.close()
        if not self.keep_log:
            Path(self.log.name).unlink(missing_ok=True)
