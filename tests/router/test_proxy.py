"""The router as a real server (uvicorn on a loopback port) over fake engines and real Redis."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import redis

from kvmesh.common.kv_events import BlockStored, KVEventSequencer
from kvmesh.index.publisher import KVEventPublisher
from kvmesh.router.app import create_app
from kvmesh.router.config import RouterConfig
from kvmesh.index.hashing import prompt_block_hashes
from kvmesh.prompt.sources import load_tokenizer
from kvmesh.router.prompt import prompt_token_ids

from .conftest import UvicornThread
from .fake_backend import make_fake_backend
from index_helpers import NS, SVC, wait_until

BS = 16
SYSTEM = ("You are a meticulous assistant for a logistics company. Answer in two sentences, cite "
          "the relevant policy number, and never invent shipment identifiers. ") * 4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


class Cluster:
    """Fake engines, each with a real KV publisher (pod id = its name), and routers on top."""

    def __init__(self, redis_server, tokenizer, names=("a", "b", "c")) -> None:
        self.redis = redis_server
        self.tokenizer = tokenizer
        self.apps = {n: make_fake_backend(n) for n in names}
        self.servers = {n: UvicornThread(app).start() for n, app in self.apps.items()}
        self.held: dict[str, set[bytes]] = {n: set() for n in names}
        self.pubs = {n: KVEventPublisher(redis_server.url, n, "m", self.servers[n].url, NS, SVC,
                                         flush_interval_s=0.01, heartbeat_interval_s=0.05,
                                         heartbeat_ttl_s=1.0, snapshot_fn=self._snapshot(n))
                     for n in names}
        self.seqs = {n: KVEventSequencer() for n in names}
        self.routers: list[UvicornThread] = []

    def _snapshot(self, name):
        return lambda: [(x, "gpu") for x in self.held[name]]

    def hashes(self, endpoint: str, body: dict) -> list[bytes]:
        ids = prompt_token_ids(self.tokenizer, endpoint, body)
        return prompt_block_hashes(ids, BS, "kvmesh", body.get("cache_salt"))

    def cache(self, name: str, endpoint: str, body: dict) -> int:
        """Pretend engine `name` cached this prompt: publish its blocks."""
        hs = self.hashes(endpoint, body)
        self.held[name].update(hs)
        self.pubs[name].publish(self.seqs[name].batch([BlockStored(hs, None, [0] * BS * len(hs),
                                                                   BS)]))
        assert self.pubs[name].flush()
        return len(hs)

    def set_load(self, name: str, running: int = 0, waiting: int = 0, kv: float = 0.0) -> None:
        self.pubs[name].update_load(running, waiting, 0, kv)
        self.apps[name].state.load = (running, waiting, kv)

    def router(self, **kw) -> str:
        kw.setdefault("backends", tuple(s.url for s in self.servers.values()))
        # NOTE: these tests check routing decisions; on a loaded CI machine a burst can delay a
        # lookup past the production deadline (0.25 s). The slow-lookup test sets its own.
        kw.setdefault("lookup_timeout_s", 5.0)
        kw.setdefault("expose_route_headers", True)     # the tests read the decision from them
        cfg = RouterConfig(redis_url=self.redis.url, namespace=NS, service=SVC, block_size=BS,
                           health_interval_s=0.1, load_interval_s=0.05, **kw)
        r = UvicornThread(create_app(cfg, self.tokenizer, "m")).start()
        self.routers.append(r)
        return r.url

    def got(self, name: str) -> int:
        return len(self.apps[name].state.requests)

    def close(self) -> None:
        for r in self.routers:
            r.stop()
        for p in self.pubs.values():
            p.close()
        for s in self.servers.values():
            s.stop()


@pytest.fixture
def cluster(redis_server, tokenizer):
    c = Cluster(redis_server, tokenizer)
    yield c
    c.close()


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def chat_body(user: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": user}], **kw}


def test_shared_prefix_goes_to_the_pod_holding_it(cluster):
    n = cluster.cache("b", "chat", chat_body("Where is shipment 1?"))
    assert n >= 4
    url = cluster.router()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200)
    for i in range(6):
        r = client.chat.completions.with_raw_response.create(
            **chat_body(f"What about shipment {i + 2}, arriving on pallet {i}?"))
        assert r.headers["x-kvmesh-route-reason"] == "prefix-hit"
        assert r.parse().choices[0].message.content == "b"
    assert (cluster.got("a"), cluster.got("b"), cluster.got("c")) == (0, 6, 0)
    # a cache salt changes every hash: no pod holds that prefix
    r = client.chat.completions.with_raw_response.create(
        **chat_body("Where is shipment 1?"), extra_body={"cache_salt": "tenant-2"})
    assert r.headers["x-kvmesh-route-reason"] == "no-prefix"
    # completions take the same path; the longer prefix wins
    long = SYSTEM + " Shipment 77 left the depot on Monday."
    cluster.cache("a", "completion", {"prompt": SYSTEM})
    cluster.cache("c", "completion", {"prompt": long})
    r = client.completions.with_raw_response.create(model="m", prompt=long + " Where is it?")
    assert (r.parse().choices[0].text, r.headers["x-kvmesh-route-reason"]) == ("c", "prefix-hit")
    assert metric(url, "kvmesh_router_decisions_total", reason="prefix-hit") == 7
    assert metric(url, "kvmesh_router_lookup_seconds_count") == 8
    assert metric(url, "kvmesh_router_prefix_hit_blocks_sum") >= 6 * n


def test_hot_prefix_spreads_when_its_pod_is_busy(cluster):
    body = chat_body("Summarise today's exceptions.")
    cluster.cache("b", "chat", body)
    url = cluster.router()
    # a heartbeat with a long queue on b: the load guard sends the prefix elsewhere
    cluster.set_load("b", running=8, waiting=20)
    assert wait_until(lambda: _route(url, body) == "load-guard")
    cluster.set_load("b")
    assert wait_until(lambda: _route(url, body) == "prefix-hit")

    # a burst of the same hot prefix: the router's own in-flight count trips the guard at once
    for app in cluster.apps.values():
        app.state.delay_s = 0.5
    before = {n: cluster.got(n) for n in cluster.apps}

    async def burst():
        async with httpx.AsyncClient(timeout=30) as c:
            rs = await asyncio.gather(*(c.post(f"{url}/v1/chat/completions", json=body)
                                        for _ in range(24)))
        return [r.headers["x-kvmesh-route-reason"] for r in rs if r.status_code == 200]

    reasons = asyncio.run(burst())
    assert len(reasons) == 24
    got = {n: cluster.got(n) - before[n] for n in cluster.apps}
    assert sum(got.values()) == 24
    # b takes up to guard_threshold + 1 more than the others, never the whole burst
    assert 9 <= got["b"] < 24 and got["a"] > 0 and got["c"] > 0, got
    assert reasons.count("load-guard") == 24 - got["b"]


def _route(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    return r.headers["x-kvmesh-route-reason"]


def test_redis_down_falls_back_to_least_loaded_and_recovers(cluster, redis_server):
    body = chat_body("Status report please.")
    cluster.cache("a", "chat", body)
    url = cluster.router()
    assert wait_until(lambda: _route(url, body) == "prefix-hit")
    cluster.set_load("a", running=5)
    cluster.set_load("b", running=3)
    redis_server.stop()
    reasons = [_route(url, body) for _ in range(10)]       # no request lost
    assert reasons[-1] == "fallback-no-redis"
    # the load now comes from the backends' /metrics: c is idle, so it gets the traffic
    assert wait_until(lambda: _route(url, body) == "fallback-no-redis"
                      and cluster.apps["c"].state.requests[-1][1] == body)
    assert metric(url, "kvmesh_router_fallbacks_total") >= 1
    assert metric(url, "kvmesh_router_redis_up") == 0
    assert httpx.get(f"{url}/ready").status_code == 200

    redis_server.start()                                    # empty: the pods resync
    assert cluster.pubs["a"].flush(timeout=10)
    cluster.set_load("a")
    assert wait_until(lambda: _route(url, body) == "prefix-hit", timeout=10)
    assert cluster.apps["a"].state.requests[-1][1] == body


def test_a_slow_lookup_falls_back_for_that_request_only(cluster, redis_server):
    body = chat_body("Status report please.")
    cluster.cache("a", "chat", body)
    url = cluster.router(lookup_timeout_s=0.1)          # heartbeat reads still wait 1 s
    assert wait_until(lambda: _route(url, body) == "prefix-hit")
    before = metric(url, "kvmesh_router_fallbacks_total")
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.client_pause(600, all=True)                   # Redis answers nothing for 0.6 s
        assert _route(url, body) == "fallback-slow-lookup"  # still served, by least load
    finally:
        admin.close()
    assert metric(url, "kvmesh_router_lookup_timeouts_total") == 1
    assert metric(url, "kvmesh_router_fallbacks_total") == before + 1
    # Redis never counted as down: the next request is kv-aware again
    assert metric(url, "kvmesh_router_redis_up") == 1
    assert wait_until(lambda: _route(url, body) == "prefix-hit")
    assert metric(url, "kvmesh_router_decisions_total", reason="fallback-no-redis") == 0


def test_a_restarted_redis_does_not_flap_routing_back_to_the_fallback(cluster, redis_server):
    """Pooled connections from before the restart are stale: none of them may fail a lookup."""
    body = chat_body("Status report please.")
    cluster.cache("a", "chat", body)
    url = cluster.router()
    assert wait_until(lambda: _route(url, body) == "prefix-hit")

    def burst(n: int) -> list[str]:
        async def go() -> list[str]:
            async with httpx.AsyncClient() as c:
                rs = await asyncio.gather(*(c.post(f"{url}/v1/chat/completions", json=body)
                                            for _ in range(n)))
            return [r.headers["x-kvmesh-route-reason"] for r in rs]
        return asyncio.run(go())

    assert "fallback-no-redis" not in burst(12)             # several pooled connections
    redis_server.stop()
    redis_server.start()                                    # empty: the pod resyncs
    assert cluster.pubs["a"].flush(timeout=10)
    assert wait_until(lambda: httpx.get(f"{url}/ready").json()["redis"]
                      and _route(url, body) == "prefix-hit", timeout=10)
    reasons = burst(12) + burst(12)
    assert "fallback-no-redis" not in reasons and "prefix-hit" in reasons, reasons
    assert metric(url, "kvmesh_router_redis_up") == 1


def test_dead_backend_is_routed_around_within_seconds(cluster):
    url = cluster.router(strategy="round-robin")
    cluster.servers["a"].stop()
    t0 = time.monotonic()
    for i in range(6):   # the first request to hit `a` is retried on another backend
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": f"hi {i}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("b", "c")
    assert wait_until(lambda: metric(url, "kvmesh_router_backend_healthy",
                                     backend=cluster.servers["a"].url) == 0, timeout=3)
    assert time.monotonic() - t0 < 5
    assert metric(url, "kvmesh_router_backend_healthy", backend=cluster.servers["b"].url) == 1
    assert httpx.get(f"{url}/ready").json()["healthy_backends"] == 2
    cluster.servers["b"].stop()
    cluster.servers["c"].stop()
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "anyone?"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503, timeout=3)


def test_streaming_passes_through_chunk_by_chunk(cluster):
    for app in cluster.apps.values():
        app.state.chunks, app.state.chunk_delay_s = 4, 0.3
    url = cluster.router()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    arrivals, texts = [], []
    stream = client.chat.completions.create(**chat_body("stream it"), stream=True)
    for chunk in stream:
        arrivals.append(time.monotonic())
        texts.append(chunk.choices[0].delta.content)
    name = texts[0].split("-")[0]
    assert texts == [f"{name}-{i} " for i in range(4)]
    # each chunk reached the client when the backend sent it, not all at the end
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert all(g > 0.15 for g in gaps), gaps
    stream = client.completions.create(model="m", prompt="go", stream=True)
    assert [c.choices[0].text for c in stream][0].endswith("-0 ")


def test_api_key_is_enforced(cluster):
    url = cluster.router(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").completions.create(
            model="m", prompt="x")
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body("x"))
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
    assert ok.completions.create(model="m", prompt="x").choices[0].text in ("a", "b", "c")
    assert [m.id for m in ok.models.list().data] == ["m"]
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200
    assert sum(cluster.got(n) for n in cluster.apps) == 1


def test_backend_errors_pass_through(cluster):
    url = cluster.router()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.status_code == 404 and "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**chat_body("x"), max_tokens=0, stream=True)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    r = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_session_affinity_and_strategies(cluster):
    url = cluster.router(session_header="X-Session-Id")
    body = chat_body("hello")
    chosen = set()
    for user in ("u1", "u2", "u3", "u4", "u5", "u6"):
        seen = {httpx.post(f"{url}/v1/chat/completions", json=body,
                           headers={"X-Session-Id": user}).headers["x-kvmesh-backend"]
                for _ in range(3)}
        assert len(seen) == 1
        chosen |= seen
    assert len(chosen) >= 2
    rr = cluster.router(strategy="round-robin")
    names = [httpx.post(f"{rr}/v1/completions", json={"model": "m", "prompt": "x"}).json()
             ["choices"][0]["text"] for _ in range(6)]
    assert sorted(names) == ["a", "a", "b", "b", "c", "c"]
    ll = cluster.router(strategy="least-loaded")
    cluster.set_load("a", running=4)
    cluster.set_load("c", running=2)
    assert wait_until(lambda: httpx.post(f"{ll}/v1/completions", json={"model": "m", "prompt": "x"})
                      .json()["choices"][0]["text"] == "b")
    assert metric(ll, "kvmesh_router_decisions_total", reason="least-loaded") >= 1


def test_discovery_by_dns_name(cluster):
    port = cluster.servers["b"].port
    url = cluster.router(backends=(), discover="localhost", backend_port=port)
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200)
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "b"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "m"


def test_in_flight_counts_return_to_zero(cluster):
    """Every path (plain, streamed, error, client gone mid-stream) releases its backend."""
    for app in cluster.apps.values():
        app.state.chunks, app.state.chunk_delay_s = 20, 0.05
    url = cluster.router()
    httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
    httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x", "stream": True})
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"model": "m", "prompt": "x", "stream": True}) as r:
        next(r.iter_raw())                    # read one chunk, then hang up
    big = "word " * 5000                      # tokenized off the event loop
    assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": big}).status_code == 200
    state = cluster.routers[-1].server.config.app.state.router
    assert wait_until(lambda: all(b.in_flight == 0 for b in state.pool.states()), timeout=5)


def test_two_backends_publishing_under_one_pod_id_are_routed_by_load(redis_server, tokenizer,
                                                                     caplog):
    """Engines a and b both publish heartbeats as pod "a" (b with its own URL): the id's URL
    flips between them. The router warns once, exports the gauge and never uses pod "a"'s prefix
    hits, which would send the request to whichever engine wrote the last heartbeat."""
    c = Cluster(redis_server, tokenizer, names=("a", "b"))
    try:
        c.pubs["b"].close()
        c.pubs["b"] = KVEventPublisher(redis_server.url, "a", "m", c.servers["b"].url, NS, SVC,
                                       flush_interval_s=0.01, heartbeat_interval_s=0.05,
                                       heartbeat_ttl_s=1.0, snapshot_fn=lambda: [])
        assert c.pubs["b"].flush()
        body = chat_body("Where is shipment 9?")
        assert c.cache("a", "chat", body) >= 4
        with caplog.at_level("WARNING", logger="kvmesh.router"):
            url = c.router()
            assert wait_until(lambda: metric(url, "kvmesh_router_duplicate_pod_ids") == 1,
                              timeout=20)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            reasons = {client.chat.completions.with_raw_response.create(**body).headers[
                "x-kvmesh-route-reason"] for _ in range(4)}
        assert reasons == {"no-prefix"}
        warned = [r for r in caplog.records if "claimed by more than one backend" in r.message]
        assert len(warned) == 1 and "pod id 'a'" in warned[0].getMessage()
    finally:
        c.close()


def test_the_tenant_salt_isolates_prefix_hits_like_the_engines(cluster):
    """--cache-salt-from header:X-Tenant: engine b holds acme's blocks of a prompt (salted as
    the engine salts them); acme's request follows them, globex's same prompt has no hit."""
    from kvmesh.common.cache_salt import CacheSaltSource
    body = chat_body("Where is shipment 12?")
    acme = CacheSaltSource.parse("header:X-Tenant").salt({"x-tenant": "acme"}, None)
    assert cluster.cache("b", "chat", {**body, "cache_salt": acme}) >= 4
    url = cluster.router(cache_salt_from="header:X-Tenant")
    assert wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def route(tenant: str) -> tuple[str, str]:
        r = client.chat.completions.with_raw_response.create(**body,
                                                              extra_headers={"X-Tenant": tenant})
        return r.headers["x-kvmesh-backend"], r.headers["x-kvmesh-route-reason"]
    assert route("acme") == (cluster.servers["b"].url, "prefix-hit")
    assert route("globex")[1] == "no-prefix"
    # the client's own cache_salt cannot claim acme's blocks
    r = client.chat.completions.with_raw_response.create(**body, extra_body={"cache_salt": acme},
                                                          extra_headers={"X-Tenant": "globex"})
    assert r.headers["x-kvmesh-route-reason"] == "no-prefix"
