"""The router's API key: checked before any tokenizing, Redis lookup or forwarding; the client's
Authorization header is forwarded to the engines; diagnostic headers only with
--expose-route-headers."""
from __future__ import annotations

import httpx
import pytest

from kvmesh.router.app import create_app
from kvmesh.router.config import RouterConfig
from kvmesh.router.main import build_parser, config_from_args

from .conftest import UvicornThread
from .fake_backend import make_fake_backend
from index_helpers import NS, SVC, wait_until

KEY = "s3cret-router-key"
BODY = {"model": "m", "prompt": "a long enough prompt to be tokenized for routing " * 4}


class SpyTokenizer:
    """Counts every use; tokenizes nothing useful (ids 1..n)."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(range(1, 65))

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        self.calls += 1
        return list(range(1, 65))


@pytest.fixture
def setup(redis_server):
    backend = UvicornThread(make_fake_backend("a")).start()
    tok = SpyTokenizer()
    cfg = RouterConfig(redis_url=redis_server.url, namespace=NS, service=SVC,
                       backends=(backend.url,), api_key=KEY, health_interval_s=0.1,
                       load_interval_s=0.05, lookup_timeout_s=5.0)
    app = create_app(cfg, tok, "m")
    state = app.state.router
    lookups: list[int] = []
    real_lookup = state.lookup

    async def spy_lookup(model, hashes):
        lookups.append(len(hashes))
        return await real_lookup(model, hashes)
    state.lookup = spy_lookup
    router = UvicornThread(app).start()
    assert wait_until(lambda: httpx.get(f"{router.url}/ready").json()["redis"] is True)
    yield router, backend.server.config.app.state, tok, lookups
    router.stop()
    backend.stop()


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic " + KEY, KEY])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_unauthenticated_request_reaches_neither_tokenizer_nor_redis_nor_backend(setup, auth,
                                                                                     path):
    router, backend, tok, lookups = setup
    body = BODY if path != "/v1/chat/completions" else {
        "model": "m", "messages": [{"role": "user", "content": BODY["prompt"]}]}
    headers = {"Authorization": auth} if auth else {}
    r = httpx.post(router.url + path, json=body, headers=headers, timeout=10)
    assert r.status_code == 401
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert (tok.calls, lookups, backend.requests) == (0, [], [])
    assert "x-kvmesh-backend" not in r.headers


def test_models_needs_the_key_and_health_ready_metrics_stay_open(setup):
    router, backend, _, _ = setup
    assert httpx.get(f"{router.url}/v1/models").status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(router.url + path).status_code == 200, path


def test_the_right_key_is_routed_and_forwarded_to_the_engine(setup):
    router, backend, tok, lookups = setup
    r = httpx.post(f"{router.url}/v1/completions", json=BODY,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200
    assert tok.calls == 1 and len(lookups) == 1
    assert backend.authorization == [f"Bearer {KEY}"]
    # diagnostics are off by default
    assert "x-kvmesh-backend" not in r.headers and "x-kvmesh-route-reason" not in r.headers


def test_route_headers_only_with_the_flag():
    backend = UvicornThread(make_fake_backend("a")).start()
    cfg = RouterConfig(backends=(backend.url,), strategy="round-robin", expose_route_headers=True,
                       health_interval_s=30.0, load_interval_s=30.0)
    router = UvicornThread(create_app(cfg, None, "m")).start()
    try:
        r = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200
        assert r.headers["x-kvmesh-backend"] == backend.url
        assert r.headers["x-kvmesh-route-reason"] == "round-robin"
    finally:
        router.stop()
        backend.stop()


def test_cli_reads_the_key_like_the_server(tmp_path, monkeypatch):
    base = ["--redis-url", "redis://x", "--backends", "http://e:8000"]
    monkeypatch.setenv("KVMESH_API_KEY", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    args = build_parser().parse_args
    assert config_from_args(args(base)).api_key == "from-env"
    assert config_from_args(args([*base, "--api-key-file", str(key_file)])).api_key == "from-file"
    assert config_from_args(args([*base, "--api-key", "flag", "--api-key-file",
                                  str(key_file)])).api_key == "flag"
    monkeypatch.delenv("KVMESH_API_KEY")
    cfg = config_from_args(args(base))
    assert cfg.api_key is None and cfg.expose_route_headers is False
    assert config_from_args(args([*base, "--expose-route-headers"])).expose_route_headers is True
