"""Readiness, back-pressure and graceful shutdown of a real server process."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import free_port

# the default --shutdown-timeout is 30 s; a server given 1 s must end its streams well before
SHUTDOWN_BOUND_S = 15.0
BODY = {"prompt": "Tell me a long story.", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


def test_ready_waits_for_the_model_then_back_pressure_then_graceful_shutdown(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port),
                             "--num-kv-blocks", "128", "--max-model-len", "512", "--max-num-seqs", "1",
                             "--max-waiting", "2", "--shutdown-timeout", "60"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        # 1) alive before ready: /health answers while the model loads, /ready says 503
        seen = set()
        # NOTE: a fresh kernel cache (a clean clone) builds the C++ kernels on this first start:
        # about a minute of compiling on two cores before the weights load
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{url}/health", timeout=1).status_code
                ready = httpx.get(f"{url}/ready", timeout=1).status_code
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.add((health, ready))
            if ready == 200:
                break
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
            if r.status_code == 200:
                # NOTE: the warm-up may finish between the /ready probe and this request; then
                # the server must say ready from now on.
                assert httpx.get(f"{url}/ready", timeout=1).status_code == 200
                continue
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            time.sleep(0.05)
        assert (200, 503) in seen and (200, 200) in seen, seen

        # 2) one running stream, two waiting requests, then the waiting queue is full: 429
        results: dict[str, object] = {}

        def stream_a():
            with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                              timeout=120) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            results["a"] = lines

        def plain(name):
            results[name] = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)

        a = threading.Thread(target=stream_a)
        a.start()
        _wait_for(lambda: _gauge(url, "kvmesh:num_requests_running") == 1)
        waiting = [threading.Thread(target=plain, args=(n,)) for n in ("b", "c")]
        for t in waiting:
            t.start()
        _wait_for(lambda: _gauge(url, "kvmesh:num_requests_waiting") == 2)
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        # a streaming request is admitted before its 200: the same 429 and OpenAI error body
        with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                          timeout=120) as rs:
            rs.read()
        assert rs.status_code == 429, rs.text
        assert rs.headers["content-type"] == "application/json"
        assert rs.json() == {"error": {"message": "the waiting queue is full (2 requests); retry later",
                                       "type": "rate_limit_error", "param": None,
                                       "code": "queue_full"}}
        assert _gauge(url, "kvmesh:requests_rejected_total") == 2
        # ... and so is a chat stream with a bad parameter: a 400, not a dropped connection
        rc = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "top_k": 2**63},
            timeout=120)
        assert rc.status_code == 400 and rc.json()["error"]["param"] == "top_k"

        # 3) SIGTERM: no new connections, in-flight requests finish, exit code 0
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _refused(url))
        for t in (a, *waiting):
            t.join(120)
        assert results["a"][-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in results["a"][-2]
        for name in ("b", "c"):
            assert results[name].status_code == 200
            assert results[name].json()["usage"]["completion_tokens"] == 40
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_shutdown_timeout_aborts_what_still_runs_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port),
                             "--num-kv-blocks", "128", "--max-model-len", "2048",
                             "--shutdown-timeout", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _ready(url), timeout=120)
        lines: list[str] = []
        errors: list[Exception] = []
        ended: list[float] = []

        def long_stream():       # ~1500 tokens: minutes on this CPU
            try:
                with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                        **BODY, "max_tokens": 1500, "stream": True}) as r:
                    lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))
            except httpx.HTTPError as e:
                errors.append(e)
            ended.append(time.monotonic())

        t = threading.Thread(target=long_stream)
        t.start()
        _wait_for(lambda: _gauge(url, "kvmesh:num_requests_running") == 1)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        t.join(30)
        assert "data: [DONE]" not in lines           # the stream was cut short ...
        assert errors or len(lines) < 1500           # ... by closing the connection ...
        # ... after the 1 s it was given, not the 30 s default. NOTE: the upper bound sits halfway
        # to the default, leaving a loaded machine 14 s to close the stream.
        assert len(ended) == 1 and 1.0 <= ended[0] - sigterm_at < SHUTDOWN_BOUND_S, \
            ended[0] - sigterm_at
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _gauge(url: str, name: str) -> float:
    """NOTE: the test checks values, not latency: a scrape may wait on a loaded machine."""
    for line in httpx.get(f"{url}/metrics", timeout=120).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=0.5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    pytest.fail("condition not reached in time")


def test_bad_server_flags_are_cli_errors(capsys):
    from kvmesh.api.server import main
    assert main(["--max-waiting", "-1"]) == 2
    assert "kvmesh serve: error: --max-waiting must be >= 0 (0: no limit), got -1" in \
        capsys.readouterr().err
    assert main(["--kv-share", "redis"]) == 2
    assert "--kv-share redis needs --redis-url" in capsys.readouterr().err
