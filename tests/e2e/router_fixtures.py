"""A real routed cluster on loopback: one redis-server, N `kvmesh serve` engines, one router.

Every process starts at once and the cluster waits for all of them together (the engines load the
model in parallel), so three engines cost about one engine's start-up. `Cluster.stop()` ends
exactly the processes it started, by their ids.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from processes import RedisServer, free_port
from servers import with_float32

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Proc:
    """One child process with its log file and base URL."""
    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path
    killed: bool = False     # SIGKILLed by kill(): its exit code is -9, not 0

    def log(self, tail: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = 30.0) -> int | None:
        """The exit code; SIGKILL after `timeout` s (then the code is -9)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.killed = True
        self.proc.wait(5)


def _spawn(name: str, argv: list[str], port: int, log_dir: Path, threads: int | None) -> Proc:
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    if threads:
        # NOTE: N engines x the default torch thread count on 2 cores oversubscribe the CPU and
        # spin-wait each other; one intra-op thread per engine keeps every step's cost stable.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log_path)


@dataclass
class Cluster:
    redis: RedisServer
    engines: list[Proc]
    router: Proc
    extra: dict = field(default_factory=dict)

    @property
    def pod_ids(self) -> list[str]:
        return [e.name for e in self.engines]

    def engine_by_url(self, url: str) -> Proc:
        return next(e for e in self.engines if e.url == url.rstrip("/"))

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM the router and the engines (all at once, exactly one signal each: a second
        one during interpreter shutdown would kill the process), then kill Redis. Exit codes."""
        procs = [self.router, *self.engines]
        for p in procs:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout) for p in procs]
        self.redis.stop()
        return codes


def start_cluster(log_dir: Path, num_engines: int = 3, engine_args: tuple[str, ...] = (),
                  router_args: tuple[str, ...] = (), strategy: str = "kv-aware",
                  engine_threads: int | None = 1, ready_timeout: float = 240.0) -> Cluster:
    """Redis, `num_engines` engines publishing to it, and a router over them, all ready."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rs = RedisServer()
    rs.start()
    engines: list[Proc] = []
    router: Proc | None = None
    try:
        for i in range(num_engines):
            port = free_port()
            engines.append(_spawn(f"pod-{i}", [
                "serve", "--host", "127.0.0.1", "--port", str(port), "--redis-url", rs.url,
                "--pod-id", f"pod-{i}", "--advertise-url", f"http://127.0.0.1:{port}",
                "--log-level", "warning", *with_float32(engine_args)], port, log_dir,
                engine_threads))
        rport = free_port()
        router = _spawn("router", [
            "router", "--host", "127.0.0.1", "--port", str(rport), "--redis-url", rs.url,
            "--backends", *[e.url for e in engines], "--strategy", strategy,
            # NOTE: three CPU engines share this machine's cores with the router; a lookup
            # delayed past the production deadline would change a decision the test checks.
            "--lookup-timeout", "2", "--expose-route-headers", "--log-level", "warning",
            *router_args], rport, log_dir,
            None)
        _wait_ready([*engines, router], ready_timeout)
        cluster = Cluster(rs, engines, router)
        _wait_heartbeats(cluster, timeout=15.0)
        return cluster
    except BaseException:
        for p in [*engines, *([router] if router else [])]:
            p.kill()
        rs.stop()
        raise


def _wait_ready(procs: list[Proc], timeout: float) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for p in list(pending):
            if not p.alive():
                raise AssertionError(f"{p.name} exited with {p.proc.returncode}:\n{p.log()}")
            try:
                if httpx.get(f"{p.url}/ready", timeout=1.0).status_code == 200:
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready in {timeout}s: {[p.name for p in pending]}:\n"
                                 + "\n".join(p.log() for p in pending))
        time.sleep(0.25)


def _wait_heartbeats(cluster: Cluster, timeout: float) -> None:
    """Until the router has read every engine's heartbeat (its pod ids are known)."""
    deadline = time.monotonic() + timeout
    client = redis.Redis(port=cluster.redis.port, decode_responses=True)
    try:
        while time.monotonic() < deadline:
            keys = client.keys("*:pod:*")
            if len(keys) >= len(cluster.engines):
                time.sleep(0.6)     # NOTE: the router reads heartbeats every ~250 ms
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError("engines never sent a heartbeat to Redis")


# ---- Prometheus helpers ----------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5.0).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for m_name, m_labels, value in _SAMPLE.findall(text):
        if m_name != name:
            continue
        if all(f'{k}="{v}"' in (m_labels or "") for k, v in labels.items()):
            total += float(value)
    return total
