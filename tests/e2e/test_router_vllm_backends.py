"""`kvmesh router --backend-kind vllm` over engines that speak only vLLM's KV-event protocol.

Two real `kvmesh serve` engines publish their KV events over ZMQ (`--kv-events-config`, vLLM's
flag and format) and NOT to Redis; the router subscribes to each (`#kv-events=PUB,REPLAY` names
each engine's ports, since both run on one host), writes kvmesh's hashes of the events' tokens
to its Redis, and scrapes load from the engines' `vllm:` metrics. Requests sharing a system
prompt must land on the engine holding it, and that engine's prefix-cache counter proves it.
(`make test-vllm` runs the same against real vLLM engines.)
"""
from __future__ import annotations

import json

import httpx
import pytest
import redis
from waiting import wait_until

from .router_fixtures import MODEL, _spawn, _wait_ready, metric_sum, scrape
from processes import RedisServer, free_port

pytestmark = pytest.mark.slow

ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4")
SYSTEM = {
    "alpha": "Alphacorp support desk. You are the assistant of Alphacorp, which sells garden "
             "tools. Answer politely and briefly, never reveal prices, and always suggest the "
             "Alphacorp help center for billing problems. Keep answers under three sentences.",
    "bravo": "Bravo Telecom support desk. You are the assistant of Bravo Telecom, which sells "
             "mobile phone plans. Answer politely and briefly, never promise coverage, and "
             "always suggest the Bravo help center for billing. Keep answers under three "
             "sentences.",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-kind")
    rs = RedisServer()
    rs.start()
    procs, backends = [], []
    try:
        for i in range(2):
            port, pub, replay = free_port(), free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                   "topic": "kv-events"}
            procs.append(_spawn(f"engine-{i}", [
                "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                "--kv-events-config", json.dumps(cfg), *ENGINE_ARGS], port, log_dir, 1))
            backends.append(f"http://127.0.0.1:{port}#kv-events={pub},{replay}")
        rport = free_port()
        router = _spawn("router", [
            "router", "--host", "127.0.0.1", "--port", str(rport), "--redis-url", rs.url,
            "--backend-kind", "vllm", "--backends", *backends, "--expose-route-headers",
            "--lookup-timeout", "2", "--log-level", "warning"], rport, log_dir, None)
        procs.append(router)
        _wait_ready(procs, 240)
        client = redis.Redis(port=rs.port, decode_responses=True)
        # the router's subscribers heartbeat for the engines (they publish nothing to Redis)
        assert wait_until(lambda: len(client.keys("*:pod:*")) == 2, timeout=15)
        client.close()
        yield procs[:2], router, rs
    finally:
        for p in procs:
            p.kill()
        rs.stop()


def chat(router_url: str, system: str, user: str) -> tuple[str, str, int]:
    r = httpx.post(f"{router_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return (r.headers["x-kvmesh-backend"], r.headers["x-kvmesh-route-reason"],
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def hits(engines) -> dict[str, float]:
    return {e.url: metric_sum(scrape(e.url), "vllm:prefix_cache_hits_total") for e in engines}


def test_shared_prefix_requests_land_on_the_engine_that_published_the_prefix(cluster):
    engines, router, rs = cluster
    client = redis.Redis(port=rs.port, decode_responses=True)
    holders = {}
    for name, system in SYSTEM.items():
        backend, reason, cached = chat(router.url, system, "Hello, who are you?")
        assert reason == "no-prefix" and cached == 0
        holders[name] = backend
        # the engine's BlockStored events reached the index through the router's subscriber
        assert wait_until(lambda: sum(1 for k in client.scan_iter("*:blk:*")) > 0, timeout=10)
    before = hits(engines)
    expected = dict.fromkeys(before, 0)
    for i in range(2):
        for name, system in SYSTEM.items():
            backend, reason, cached = chat(router.url, system, f"Question {i}: a refund?")
            assert (backend, reason) == (holders[name], "prefix-hit")
            assert cached >= 3 * 16
            expected[backend] += cached
    after = hits(engines)
    assert {u: after[u] - before[u] for u in after} == {u: float(v) for u, v in expected.items()}
    # the index holds exactly what each engine's events said, under the router's pod ids
    pods = {k.rsplit(":pod:", 1)[1] for k in client.keys("*:pod:*")}
    assert pods == {e.url.removeprefix("http://") for e in engines}
    client.close()
