"""Server processes the benchmarks start on loopback: one helper for every script.

`ServerProcess` starts a command with its output in a log file, waits until an HTTP path answers
200, and stops it with SIGTERM (SIGKILL after a timeout), returning its exit code. The load
scenarios (`load_scenarios.py`) run `kvmesh serve` through it, the serving benchmark
(`serving.py`) runs `kvmesh serve` and `vllm serve` through it. The routed cluster (Redis, engines,
router) comes from `tests/e2e/router_fixtures.start_cluster`, as `routing.py` uses it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class ServerError(RuntimeError):
    """A server could not start, exited early, or was not ready in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    """One server subprocess: its command, log file and base URL."""

    name: str
    argv: list[str]
    url: str
    log_path: Path
    ready_path: str = "/ready"       # answers 200 once the server takes requests
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            try:
                # NOTE: a session of its own, so a stop that has to kill also ends the children it
                # started (vLLM's engine process), and nothing else.
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
            except OSError as e:
                raise ServerError(f"{self.name}: could not start {self.argv[0]}: {e}") from None
        return self

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.3) -> None:
        """Until `ready_path` answers 200; ServerError (and the process stopped) otherwise."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with status {self.proc.returncode} before "
                                  f"it was ready; its log ({self.log_path}) ends with:\n"
                                  f"{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        self.stop()
        raise ServerError(f"{self.name} was not ready in {timeout:.0f} s; its log "
                          f"({self.log_path}) ends with:\n{self.log_tail()}")

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM, then SIGKILL to its process group after `timeout` s; the exit code (-9 when
        killed)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            return -9

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""
