"""benchmarks/servers.py: start, readiness, stop, and the failures a benchmark must report.
The servers here are real processes (Python's own http.server, or scripts that misbehave)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks.servers import ServerError, ServerProcess, free_port


def _proc(tmp_path, argv, url="http://127.0.0.1:1", ready_path="/") -> ServerProcess:
    return ServerProcess("test server", argv, url, tmp_path / "server.log", ready_path=ready_path)


def test_ready_then_stopped_with_sigterm(tmp_path):
    port = free_port()
    p = _proc(tmp_path, [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
              f"http://127.0.0.1:{port}").start()
    p.wait_ready(timeout=60)
    # http.server dies of SIGTERM (no handler): the exit code says so
    assert p.stop(timeout=30) == -15


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    p = _proc(tmp_path, [sys.executable, "-c",
                         "import sys; print('cannot load the model'); sys.exit(3)"]).start()
    with pytest.raises(ServerError, match=r"(?s)test server exited with status 3 before it was "
                                          r"ready; its log \(.*server.log\) ends with:\ncannot "
                                          r"load the model"):
        p.wait_ready(timeout=60)


def test_a_server_never_ready_is_stopped(tmp_path):
    p = _proc(tmp_path, [sys.executable, "-c", "import time; print('loading'); time.sleep(600)"],
              f"http://127.0.0.1:{free_port()}").start()
    with pytest.raises(ServerError, match=r"(?s)was not ready in 2 s.*loading"):
        p.wait_ready(timeout=2.0)
    assert p.proc.poll() is not None


def test_a_stop_that_must_kill_ends_the_children_too(tmp_path):
    child_pid = tmp_path / "child.pid"
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(child_pid)!r}, 'w').write(str(c.pid))\n"
              "time.sleep(600)\n")
    p = _proc(tmp_path, [sys.executable, "-c", script]).start()
    deadline = time.monotonic() + 60
    while not (child_pid.exists() and child_pid.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert p.stop(timeout=1.0) == -9
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the server's child {pid} outlived the stop")


def test_a_command_that_cannot_start(tmp_path):
    with pytest.raises(ServerError, match="test server: could not start /nonexistent/server"):
        _proc(tmp_path, ["/nonexistent/server"]).start()
