"""The router's graceful shutdown is bounded (`--shutdown-timeout`, as `kvmesh serve`'s): a stream
still running through it when SIGTERM comes is cut after the time it was given, and the router
exits 0. Before the bound, uvicorn waited for every open connection: one stream that never ended
kept the router up.

Real processes: redis-server, one `kvmesh serve` engine (given 120 s to finish its own streams),
one `kvmesh router` given 1 s.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from waiting import wait_until

from .router_fixtures import MODEL, metric_sum, scrape, start_cluster

pytestmark = pytest.mark.slow


def test_a_stream_outliving_the_router_shutdown_timeout_is_cut_and_the_router_exits_0(tmp_path):
    cluster = start_cluster(tmp_path, 1, engine_args=("--num-kv-blocks", "128", "--max-model-len", "2048",
                                                      "--shutdown-timeout", "120"),
                            router_args=("--shutdown-timeout", "1"))
    engine, router = cluster.engines[0], cluster.router
    lines: list[str] = []
    ended: list[float] = []
    try:
        def long_stream():       # ~1500 tokens: minutes on this CPU
            try:
                with httpx.stream("POST", f"{router.url}/v1/completions", timeout=120, json={
                        "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500,
                        "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                    lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))
            except httpx.HTTPError:
                pass
            ended.append(time.monotonic())

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        assert wait_until(lambda: len(lines) >= 2, timeout=120, interval=0.1)
        sigterm_at = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(60) == 0
        t.join(30)
        assert "data: [DONE]" not in lines                     # cut short, not finished
        # NOTE: the bound sits far below the engine's 120 s: the router's own timeout cut it
        assert len(ended) == 1 and ended[0] - sigterm_at < 20, ended
        assert engine.alive()
    finally:
        cluster.stop()


def test_a_negative_shutdown_timeout_is_refused():
    proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "router", "--redis-url", "redis://127.0.0.1:9",
                           "--backends", "http://127.0.0.1:9",
                           "--shutdown-timeout", "-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--shutdown-timeout must be >= 0 seconds, got -1.0" in proc.stderr
