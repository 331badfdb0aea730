"""Router settings for vLLM backends: `--backend-kind`, `KIND=URL[#kv-events=PUB,REPLAY]`, the
kv-events ports, and where each backend's subscriber connects."""
from __future__ import annotations

import pytest

from kvmesh.index.vllm_subscriber import VllmSource
from kvmesh.router.backends import BackendPool, BackendSpec, parse_backend
from kvmesh.router.config import RouterConfig
from kvmesh.router.main import build_parser, config_from_args
from kvmesh.router.vllm_events import source_for

REDIS = "redis://127.0.0.1:6379/0"


def test_backend_entries_parse_with_kind_url_and_ports():
    assert parse_backend("http://a:8000", "kvmesh") == BackendSpec("kvmesh", "http://a:8000", None)
    assert parse_backend("http://a:8000", "vllm") == BackendSpec("vllm", "http://a:8000", None)
    assert parse_backend("vllm=http://10.0.0.5:8000/", "kvmesh") == \
        BackendSpec("vllm", "http://10.0.0.5:8000", None)
    assert parse_backend("kvmesh=localhost:9000", "vllm") == \
        BackendSpec("kvmesh", "http://127.0.0.1:9000", None)
    assert parse_backend("vllm=http://127.0.0.1:8001#kv-events=5601,5602", "kvmesh") == \
        BackendSpec("vllm", "http://127.0.0.1:8001", (5601, 5602))
    assert parse_backend("http://127.0.0.1:8001#kv-events=5601", "vllm") == \
        BackendSpec("vllm", "http://127.0.0.1:8001", (5601, 0))
    # a URL whose query holds '=' is a URL, not KIND=URL
    assert parse_backend("http://a:1/?x=y", "kvmesh").kind == "kvmesh"


@pytest.mark.parametrize("entry, message", [
    ("sglang=http://a:1", "backend kind must be one of kvmesh, vllm, got 'sglang'"),
    ("vllm=", "has no URL"),
    ("kvmesh=http://a:1#kv-events=5601", "the only annotation is #kv-events"),
    ("vllm=http://a:1#events=5601", "the only annotation is #kv-events"),
    ("vllm=http://a:1#kv-events=5601,5601", "two different TCP ports"),
    ("vllm=http://a:1#kv-events=70000", "two different TCP ports"),
])
def test_bad_backend_entries_are_clear_errors(entry, message):
    with pytest.raises(ValueError) as e:
        RouterConfig(redis_url=REDIS, backends=(entry,))
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"backend_kind": "tgi"}, "--backend-kind must be one of kvmesh, vllm"),
    ({"backend_kind": "vllm", "redis_url": None}, "vLLM backends need --redis-url"),
    ({"backends": ("vllm=http://a:1",), "redis_url": None}, "vLLM backends need --redis-url"),
    ({"kv_events_port": 0}, "--kv-events-port must be a TCP port"),
    ({"kv_events_replay_port": 5557}, "--kv-events-replay-port must be a TCP port other than"),
    ({"kv_events_replay_port": -1}, "--kv-events-replay-port must be a TCP port other than"),
])
def test_bad_kv_event_settings_are_clear_errors(kwargs, message):
    base = {"redis_url": REDIS, "backends": ("http://a:1",)}
    with pytest.raises(ValueError) as e:
        RouterConfig(**{**base, **kwargs})
    assert message in str(e.value)


def test_cli_flags_reach_the_config_and_the_pool():
    args = build_parser().parse_args([
        "--redis-url", REDIS, "--backend-kind", "vllm", "--backends", "http://10.0.0.5:8000",
        "kvmesh=http://10.0.0.6:8000", "http://10.0.0.7:8000#kv-events=6001,0",
        "--kv-events-port", "6557", "--kv-events-replay-port", "0", "--kv-events-topic", "t"])
    cfg = config_from_args(args)
    assert (cfg.backend_kind, cfg.kv_events_port, cfg.kv_events_replay_port,
            cfg.kv_events_topic) == ("vllm", 6557, 0, "t")
    pool = BackendPool(list(cfg.backends), default_kind=cfg.backend_kind)
    assert [(b.url, b.kind) for b in pool.states()] == [
        ("http://10.0.0.5:8000", "vllm"), ("http://10.0.0.6:8000", "kvmesh"),
        ("http://10.0.0.7:8000", "vllm")]
    assert pool.kv_events_ports == {"http://10.0.0.7:8000": (6001, 0)}
    assert source_for("http://10.0.0.5:8000", cfg) == VllmSource(
        "10.0.0.5:8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:6557", None, "t")
    assert source_for("http://10.0.0.7:8000", cfg, (6001, 6002)) == VllmSource(
        "10.0.0.7:8000", "http://10.0.0.7:8000", "tcp://10.0.0.7:6001", "tcp://10.0.0.7:6002",
        "t")
    assert source_for("http://[fd00::5]:8000", RouterConfig(redis_url=REDIS, backends=("x:1",))
                      ).endpoint == "tcp://[fd00::5]:5557"


async def test_discovered_backends_take_the_default_kind(monkeypatch):
    import asyncio
    import socket
    pool = BackendPool(discover="engines.svc", backend_port=8000, default_kind="vllm")

    async def fake_getaddrinfo(host, port, type):  # noqa: A002
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.9", port))]
    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
    await pool.discover_now()
    assert [(b.url, b.kind) for b in pool.states()] == [("http://10.1.0.9:8000", "vllm")]


def test_subscribers_follow_the_vllm_backends_as_they_come_and_go(redis_server):
    """One subscriber per vLLM backend (none for kvmesh ones); health and /metrics load reach
    it; a backend that leaves has its subscriber stopped and its index entries cleared."""
    from fake_vllm import FakeVllmPublisher, VStored
    from index_helpers import index_call
    from waiting import wait_until

    from kvmesh.router.vllm_events import VllmEventSources
    pub = FakeVllmPublisher()
    cfg = RouterConfig(redis_url=redis_server.url, namespace="testns", service="testsvc",
                       backends=(f"vllm=http://127.0.0.1:8001#kv-events={pub.pub_port},"
                                 f"{pub.replay_port}", "http://127.0.0.1:8002"), block_size=4)
    pool = BackendPool(list(cfg.backends))
    sources = VllmEventSources(cfg, "m", heartbeat_interval_s=0.1, heartbeat_ttl_s=2.0)
    try:
        pool.scraped_load["http://127.0.0.1:8001"] = (3, 1, 0.25)
        sources.sync(pool)
        assert list(sources.subscribers) == ["http://127.0.0.1:8001"]
        sub = sources.subscribers["http://127.0.0.1:8001"]
        assert wait_until(lambda: 0 in pub.replay_requests)
        pub.send(VStored([11], None, [5, 6, 7, 8], 4))
        live = {}
        assert wait_until(lambda: live.update(index_call(redis_server.url, "live_pods")) or
                          "127.0.0.1:8001" in live)
        p = live["127.0.0.1:8001"]
        assert (p.url, p.model, p.running, p.waiting, p.kv_usage) == \
            ("http://127.0.0.1:8001", "m", 3, 1, 0.25)
        assert wait_until(lambda: index_call(redis_server.url, "dump", "m") != {})
        from prometheus_client import CollectorRegistry, generate_latest
        from kvmesh.router.vllm_events import VllmEventsCollector
        registry = CollectorRegistry()
        registry.register(VllmEventsCollector(sources))
        text = generate_latest(registry).decode()
        assert 'kvmesh_router_vllm_events_live{backend="http://127.0.0.1:8001"} 1.0' in text
        assert ('kvmesh_router_vllm_events_batches_applied_total{backend="http://127.0.0.1:8001"}'
                ' 1.0') in text

        pool.backends["http://127.0.0.1:8001"].healthy = False
        sources.sync(pool)
        assert not sub.live
        del pool.backends["http://127.0.0.1:8001"]
        sources.sync(pool)
        assert sources.subscribers == {} and not sub.running
        assert index_call(redis_server.url, "dump", "m") == {}
        assert index_call(redis_server.url, "live_pods") == {}
    finally:
        sources.stop()
        pub.close()


def test_a_router_with_vllm_backends_exports_their_subscribers():
    from prometheus_client import generate_latest

    from kvmesh.router.app import RouterState
    state = RouterState(RouterConfig(redis_url=REDIS, backends=("vllm=http://a:1", "http://b:2")),
                        model_name="m")
    assert state.vllm is not None and state.vllm.target.model == "m"
    assert b"kvmesh_router_vllm_events_live" in generate_latest(state.metrics.registry)
    assert RouterState(RouterConfig(redis_url=REDIS, backends=("http://b:2",))).vllm is None
