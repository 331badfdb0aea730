"""`kvmesh router --backend-kind vllm` over engines that speak only vLLM's KV-event protocol.

Two real `kvmesh serve` engines publish their KV events over ZMQ (`--kv-events-config`, vLLM's
flag and format) and NOT to Redis; the router subscribes to each (`#kv-events=PUB,REPLAY` names
each engine's ports, since both run on one host), writes kvmesh's hashes of the events' tokens
to its Redis, and scrapes load from the engines' `vllm:` metrics. Requests sharing a prefix must
land on the engine holding it, and that engine's prefix-cache counter proves it.
(`make test-vllm` runs the same against real vLLM engines.)
"""
from __future__ import annotations

import json

import httpx
import pytest
import redis
from waiting import wait_until

from .router_fixtures import _spawn, _wait_ready, metric_sum, scrape
from processes import RedisServer, free_port

pytestmark = pytest.mark.slow

ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4",
               "--served-model-name", "tiny")
VOCAB = 256
# NOTE: a tiny seeded model with a word-level tokenizer (w3, w4, ...): the engines start in
# seconds; the routing and the events do not depend on the model's size.
FAMILY = {"alpha": " ".join(f"w{i}" for i in range(10, 58)),        # 48 tokens: 3 full blocks
          "bravo": " ".join(f"w{i}" for i in range(100, 148))}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import torch
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    return save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / "tiny", seed=3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
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
                "--model", str(tiny_model_dir), "--kv-events-config", json.dumps(cfg),
                *ENGINE_ARGS], port, log_dir, 1))
            backends.append(f"http://127.0.0.1:{port}#kv-events={pub},{replay}")
        rport = free_port()
        router = _spawn("router", [
            "router", "--host", "127.0.0.1", "--port", str(rport), "--redis-url", rs.url,
            "--backend-kind", "vllm", "--backends", *backends, "--expose-route-headers",
            "--model", str(tiny_model_dir), "--served-model-name", "tiny",
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


def complete(router_url: str, prefix: str, suffix: str) -> tuple[str, str]:
    r = httpx.post(f"{router_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": f"{prefix} {suffix}", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers["x-kvmesh-backend"], r.headers["x-kvmesh-route-reason"]


def hits(engines) -> dict[str, float]:
    return {e.url: metric_sum(scrape(e.url), "vllm:prefix_cache_hits_total") for e in engines}


def test_shared_prefix_requests_land_on_the_engine_that_published_the_prefix(cluster):
    engines, router, rs = cluster
    client = redis.Redis(port=rs.port, decode_responses=True)
    holders = {}
    for name, prefix in FAMILY.items():
        holders[name], reason = complete(router.url, prefix, "w3 w4")
        assert reason == "no-prefix"
    # the engines' BlockStored events reach the index through the router's subscribers
    assert wait_until(lambda: sum(1 for _ in client.scan_iter("*:blk:*")) >= 6, timeout=10)
    before = hits(engines)
    expected = dict.fromkeys(before, 0)
    for i in range(2):
        for name, prefix in FAMILY.items():
            backend, reason = complete(router.url, prefix, f"w{200 + i} w{210 + i}")
            assert (backend, reason) == (holders[name], "prefix-hit")
            expected[backend] += 48          # the 3 shared blocks
    after = hits(engines)
    assert {u: after[u] - before[u] for u in after} == {u: float(v) for u, v in expected.items()}
    # the router heartbeats for each engine under its host:port
    pods = {k.rsplit(":pod:", 1)[1] for k in client.keys("*:pod:*")}
    assert pods == {e.url.removeprefix("http://") for e in engines}
    client.close()
