"""Real `kvmesh serve` processes on free loopback ports, for any test folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from processes import free_port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not exit on SIGTERM:\n{self.log()[-3000:]}")


def with_float32(args) -> tuple[str, ...]:
    """`args` plus `--dtype float32` unless they name a dtype.

    NOTE: these servers' tests compare exact answers (with transformers' float32 forward, or one
    server's with another's); `--dtype auto` picks bfloat16 on CPUs with AVX512-BF16 or AMX, where
    a near-tie may flip. The default dtype is covered by test_server_startup and
    test_server_loading, which start `kvmesh serve` as a new user does."""
    args = tuple(args)
    return args if any(a == "--dtype" or a.startswith("--dtype=") for a in args) else (*args, "--dtype", "float32")


def start_server(tmp_path, *args: str, ready_timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """`env` adds variables to the server's environment (e.g. a PYTHONPATH with a fault)."""
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    args = with_float32(args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"server not ready in {ready_timeout}s:\n{server.log()[-3000:]}")
