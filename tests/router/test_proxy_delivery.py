"""Exactly-once delivery through the router: a request is re-sent only when it never reached a
backend or died with the backend's process (its address refuses connections after the break), a
backend that read it and broke the connection but still listens answers the client 502, and a
client that leaves before its non-streaming answer cancels the request on the backend."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kvmesh.router.app import BACKEND_KEEPALIVE_S, create_app
from kvmesh.router.config import RouterConfig

from .conftest import UvicornThread
from .fake_backend import make_fake_backend
from waiting import wait_until


class ReadsThenCloses:
    """A TCP server that reads one whole HTTP request (headers and Content-Length body) per
    connection, counts it as delivered, and closes without answering: a backend that dies
    after it took the request."""

    def __init__(self, die: bool = False, listener_outlives_s: float = 0.0) -> None:
        self.die = die          # after the first request, stop listening (a killed process)
        self.listener_outlives_s = listener_outlives_s   # ... this long after the connection
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.delivered: list[bytes] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if not data:        # connected and left without a request (a probe)
                    continue
                head, _, body = data.partition(b"\r\n\r\n")
                if head.startswith(b"GET"):      # health checks pass
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 15\r\nconnection: close\r\n\r\n"
                                 b'{"status":"ok"}')
                    continue
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                self.delivered.append(body)
                if self.die:
                    # NOTE: as when the kernel closes a killed process's sockets: the listener
                    # goes first, or just after the connection (a probe in between is accepted
                    # into the backlog, then reset)
                    if self.listener_outlives_s:
                        conn.close()
                        time.sleep(self.listener_outlives_s)
                    self._stop = True
                    self.sock.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def _router(backends: list[str], **kw) -> UvicornThread:
    cfg = RouterConfig(backends=tuple(backends), strategy="round-robin",
                       health_interval_s=30.0, load_interval_s=30.0, **kw)
    return UvicornThread(create_app(cfg, None, "m")).start()


@pytest.fixture
def good():
    server = UvicornThread(make_fake_backend("good")).start()
    yield server
    server.stop()


def test_a_backend_that_read_the_request_and_died_is_not_retried(good):
    bad = ReadsThenCloses()
    router = _router([bad.url, good.url])
    try:
        statuses = []
        for i in range(2):
            r = httpx.post(f"{router.url}/v1/completions",
                           json={"model": "m", "prompt": f"once {i}"}, timeout=10)
            statuses.append(r.status_code)
            if r.status_code == 502:
                err = r.json()["error"]
                assert (err["type"], err["code"]) == ("bad_gateway", "backend_failed")
                assert "not retried" in err["message"]
        # 2 client requests -> exactly 2 deliveries in all: the one the bad backend took was
        # answered 502, never sent again to the good one
        assert len(bad.delivered) + len(good.server.config.app.state.requests) == 2
        assert len(bad.delivered) == 1 and statuses.count(502) == 1 and statuses.count(200) == 1
    finally:
        router.stop()
        bad.close()


@pytest.mark.parametrize("listener_outlives_s", [0.0, 0.3], ids=["refused", "accepted-then-reset"])
def test_a_request_that_died_with_its_backends_process_is_sent_once_to_another(good,
                                                                               listener_outlives_s):
    """The backend read the request, then its process died (its listener closed, before the
    router's probe, which is refused, or after it, which resets the probe): the request can never
    be answered there and goes to the other backend; every client request is answered once and
    delivered to the good backend once."""
    dead = ReadsThenCloses(die=True, listener_outlives_s=listener_outlives_s)
    router = _router([dead.url, good.url])
    try:
        replies = [httpx.post(f"{router.url}/v1/completions",
                              json={"model": "m", "prompt": f"once {i}"}, timeout=10)
                   for i in range(2)]
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        assert [r.json()["choices"][0]["text"] for r in replies] == ["good", "good"]
        # (which request round-robin sends to the dead backend depends on the ports' order)
        assert len(dead.delivered) == 1
        assert sorted(b["prompt"] for _, b in good.server.config.app.state.requests) == \
            ["once 0", "once 1"]
        assert "kvmesh_router_retries_total 1.0" in httpx.get(f"{router.url}/metrics").text
    finally:
        router.stop()
        dead.close()


def test_a_refused_connection_is_retried_once_and_never_twice():
    """Three backends pass their first health check, then the first and the last (in the pool's
    URL order, round-robin's order) die. The request goes to the first (refused), is retried
    once on the last (refused: the middle one is the only healthy candidate left after the
    first failure, but round-robin's next turn is the last) and stops there: a 502 after two
    connection attempts; the middle backend never sees it. The next request reaches it."""
    servers = sorted((UvicornThread(make_fake_backend(f"s{i}")).start() for i in range(3)),
                     key=lambda t: t.url)
    first, middle, last = servers
    router = _router([t.url for t in servers])
    try:
        assert wait_until(lambda: httpx.get(f"{router.url}/ready").json().get(
            "healthy_backends") == 3, timeout=5)
        first.stop()
        last.stop()
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "x"},
                       timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "backend_unreachable"
        assert "2 tried" in r.json()["error"]["message"]
        assert middle.server.config.app.state.requests == []
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "y"},
                       timeout=10)
        assert r.status_code == 200
        assert len(middle.server.config.app.state.requests) == 1
        assert "kvmesh_router_retries_total 1.0" in httpx.get(f"{router.url}/metrics").text
    finally:
        router.stop()
        middle.stop()


def test_an_idle_backend_connection_is_dropped_before_the_backend_closes_it(good):
    """The router reuses a kept-alive connection to a backend, but drops one idle for
    BACKEND_KEEPALIVE_S, before the backend's own 5 s idle timeout (uvicorn's default, which the
    fake backend keeps) can close it under a request being written: that race broke a request
    unread and answered the client 502. Same connection back to back; a new one after the idle
    time."""
    assert good.server.config.timeout_keep_alive == 5 and BACKEND_KEEPALIVE_S <= 5 / 2
    peers = good.server.config.app.state.peers
    router = _router([good.url])
    try:
        for i in range(2):
            r = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": f"{i}"},
                           timeout=10)
            assert r.status_code == 200
        assert peers[0] == peers[1]              # kept alive
        time.sleep(BACKEND_KEEPALIVE_S + 0.5)    # idle: longer than the router keeps it, shorter
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "2"},
                       timeout=10)               # than the backend does
        assert r.status_code == 200
        assert len(peers) == 3 and peers[2] != peers[1]
    finally:
        router.stop()


def test_a_client_that_leaves_cancels_its_non_streaming_request_on_the_backend(good):
    app = good.server.config.app
    app.state.delay_s = 20.0
    router = _router([good.url])
    try:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "bye"},
                       timeout=httpx.Timeout(5.0, read=0.5))
        # the backend sees its client (the router) go away long before its 20 s of work end
        assert wait_until(lambda: len(app.state.disconnects) == 1, timeout=5)
        assert time.monotonic() - t0 < 6
        text = httpx.get(f"{router.url}/metrics").text
        assert "kvmesh_router_client_disconnects_total 1.0" in text
    finally:
        router.stop()


def test_a_backend_that_dies_mid_stream_is_reported_in_the_stream(good):
    """The client gets the chunks that were sent, then one OpenAI-style error event and [DONE]:
    never an answer that is silently cut short."""
    app = good.server.config.app
    app.state.chunks, app.state.die_after_chunks = 4, 2
    router = _router([good.url])
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                          json={"model": "m", "prompt": "x", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert [e["choices"][0]["text"] for e in events[:2]] == ["good-0 ", "good-1 "]
        assert events[2]["error"]["code"] == "backend_failed"
        assert events[2]["error"]["type"] == "bad_gateway"
        assert len(events) == 3 and lines[-1] == "data: [DONE]"
    finally:
        router.stop()
