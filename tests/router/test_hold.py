"""Holding requests while no engine is ready (scale from zero): a real router server (uvicorn on a
loopback port) over a fake engine that starts on its port only when the test says so."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from kvmesh.router.app import create_app
from kvmesh.router.config import RouterConfig
from kvmesh.router.hold import RETRY_AFTER_S

from .conftest import UvicornThread, free_port
from .fake_backend import make_fake_backend
from .test_proxy import metric
from index_helpers import wait_until

pytestmark = pytest.mark.timeout(60)


class Zero:
    """A router whose one backend (an engine scaled to zero) is not there until `start_engine()`."""

    def __init__(self, **router_kw) -> None:
        self.engine_port = free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.engine: UvicornThread | None = None
        self.app = make_fake_backend("e")
        cfg = RouterConfig(backends=(self.engine_url,), strategy="least-loaded",
                           health_interval_s=0.1, **router_kw)
        self.router = UvicornThread(create_app(cfg, None, "m")).start()
        self.url = self.router.url
        # the first health round marks the missing engine unhealthy
        assert wait_until(lambda: metric(self.url, "kvmesh_router_backend_healthy",
                                         backend=self.engine_url) == 0, timeout=5)

    def start_engine(self) -> None:
        self.engine = UvicornThread(self.app, port=self.engine_port).start()

    def pending(self) -> float:
        return metric(self.url, "kvmesh_router_pending_requests", model_name="m")

    def outcome(self, outcome: str) -> float:
        return metric(self.url, "kvmesh_router_held_requests_total", outcome=outcome)

    def close(self) -> None:
        self.router.stop()
        if self.engine is not None:
            self.engine.stop()


@pytest.fixture
def zero_factory():
    made: list[Zero] = []

    def make(**kw) -> Zero:
        made.append(Zero(**kw))
        return made[-1]
    yield make
    for z in made:
        z.close()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - surfaced by the test's asserts
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_without_hold_timeout_no_engine_is_a_503_at_once(zero_factory):
    z = zero_factory()
    t0 = time.monotonic()
    r = httpx.post(f"{z.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S) == "5"
    assert r.json() == {"error": {"message": "no healthy backend to serve the request",
                                  "type": "service_unavailable", "param": None,
                                  "code": "no_healthy_backend"}}
    assert httpx.get(f"{z.url}/ready").status_code == 503
    assert z.outcome("timeout") == 0


def test_held_requests_are_sent_once_an_engine_is_ready(zero_factory):
    z = zero_factory(hold_timeout_s=30)
    client = openai.OpenAI(base_url=f"{z.url}/v1", api_key="none", max_retries=0)
    plain, plain_out = _in_thread(lambda: client.completions.create(model="m", prompt="wake"))
    stream, stream_out = _in_thread(lambda: [c.choices[0].delta.content for c in
                                             client.chat.completions.create(
                                                 model="m", stream=True,
                                                 messages=[{"role": "user", "content": "up"}])])
    assert wait_until(lambda: z.pending() == 2, timeout=5)
    ready = httpx.get(f"{z.url}/ready")
    assert ready.status_code == 200 and ready.json()["held_requests"] == 2
    time.sleep(0.5)
    assert plain.is_alive() and stream.is_alive()      # still waiting, nothing answered
    z.start_engine()
    plain.join(10)
    stream.join(10)
    assert "error" not in plain_out and "error" not in stream_out, (plain_out, stream_out)
    assert plain_out["value"].choices[0].text == "e"
    assert stream_out["value"] == ["e-0 ", "e-1 ", "e-2 "]
    # each request reached the engine exactly once
    assert sorted(p for p, _ in z.app.state.requests) == ["/v1/chat/completions", "/v1/completions"]
    assert (z.pending(), z.outcome("sent"), z.outcome("timeout")) == (0, 2, 0)


def test_hold_timeout_answers_503_with_retry_after(zero_factory):
    z = zero_factory(hold_timeout_s=0.6)
    t0 = time.monotonic()
    r = httpx.post(f"{z.url}/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    waited = time.monotonic() - t0
    assert 0.6 <= waited < 3.0
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"] == {"message": "no engine became ready within --hold-timeout 0.6 s",
                                 "type": "service_unavailable", "param": None,
                                 "code": "no_healthy_backend"}
    with pytest.raises(openai.InternalServerError) as e:
        openai.OpenAI(base_url=f"{z.url}/v1", api_key="none", max_retries=0).completions.create(
            model="m", prompt="x")
    assert e.value.status_code == 503 and e.value.code == "no_healthy_backend"
    assert (z.outcome("timeout"), z.pending()) == (2, 0)


def test_beyond_max_held_requests_a_503_at_once_and_the_held_ones_still_go(zero_factory):
    z = zero_factory(hold_timeout_s=30, max_held_requests=2)
    held = [_in_thread(lambda i=i: httpx.post(f"{z.url}/v1/completions",
                                              json={"model": "m", "prompt": f"p{i}"}, timeout=20))
            for i in range(2)]
    assert wait_until(lambda: z.pending() == 2, timeout=5)
    t0 = time.monotonic()
    r = httpx.post(f"{z.url}/v1/completions", json={"model": "m", "prompt": "third"})
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "too_many_held_requests"
    assert r.json()["error"]["message"] == ("no engine is ready and 2 requests are already held "
                                            "(--max-held-requests 2)")
    z.start_engine()
    for t, out in held:
        t.join(10)
        assert out["value"].status_code == 200 and out["value"].json()["choices"][0]["text"] == "e"
    assert sorted(b["prompt"] for _, b in z.app.state.requests) == ["p0", "p1"]
    assert (z.outcome("full"), z.outcome("sent"), z.pending()) == (1, 2, 0)


def test_a_held_client_that_leaves_is_dropped_and_never_sent(zero_factory):
    z = zero_factory(hold_timeout_s=30)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{z.url}/v1/completions", json={"model": "m", "prompt": "gone"},
                   timeout=httpx.Timeout(5.0, read=0.5))
    assert wait_until(lambda: z.outcome("disconnected") == 1, timeout=5)
    assert z.pending() == 0
    z.start_engine()
    assert wait_until(lambda: httpx.get(f"{z.url}/ready").json()["healthy_backends"] == 1,
                      timeout=5)
    r = httpx.post(f"{z.url}/v1/completions", json={"model": "m", "prompt": "here"})
    assert r.status_code == 200
    assert [b["prompt"] for _, b in z.app.state.requests] == ["here"]
    assert (z.outcome("sent"), z.outcome("disconnected")) == (0, 1)


def test_a_loading_engine_is_not_ready_until_its_ready_endpoint_says_so(zero_factory):
    """A kvmesh engine answers /health while its model loads (and refuses requests with 503
    not_ready): a held request waits for /ready, then goes once."""
    from fastapi.responses import JSONResponse
    z = zero_factory(hold_timeout_s=30)
    z.app.state.loading = True

    @z.app.get("/ready")
    async def ready():
        if z.app.state.loading:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready"}

    t, out = _in_thread(lambda: httpx.post(f"{z.url}/v1/completions",
                                           json={"model": "m", "prompt": "held"}, timeout=20))
    assert wait_until(lambda: z.pending() == 1, timeout=5)
    z.start_engine()
    time.sleep(0.6)                     # several health rounds see /health 200, /ready 503
    assert z.pending() == 1 and z.app.state.requests == []
    assert metric(z.url, "kvmesh_router_backend_healthy", backend=z.engine_url) == 0
    z.app.state.loading = False
    t.join(10)
    assert out["value"].status_code == 200 and out["value"].json()["choices"][0]["text"] == "e"
    assert [b["prompt"] for _, b in z.app.state.requests] == ["held"]


def test_hold_flags_and_their_validation(capsys):
    from kvmesh.router.main import build_parser, config_from_args, main
    base = ["--redis-url", "redis://x", "--backends", "http://127.0.0.1:1"]
    cfg = config_from_args(build_parser().parse_args(base))
    assert (cfg.hold_timeout_s, cfg.max_held_requests) == (0.0, 256)       # off by default
    cfg = config_from_args(build_parser().parse_args(
        [*base, "--hold-timeout", "90", "--max-held-requests", "8"]))
    assert (cfg.hold_timeout_s, cfg.max_held_requests) == (90.0, 8)
    assert main([*base, "--hold-timeout", "-1"]) == 2
    assert "--hold-timeout must be >= 0 seconds (0: do not hold), got -1.0" in capsys.readouterr().err
    assert main([*base, "--max-held-requests", "0"]) == 2
    assert "--max-held-requests must be >= 1, got 0" in capsys.readouterr().err
