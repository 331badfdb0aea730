"""The KV-aware router over real engine processes (issue 6): one redis-server, three `kvmesh serve`
engines publishing their KV events, one `kvmesh router --strategy kv-aware`, driven through the
real `openai` client.

The tests share one cluster (started once, in parallel) and run in file order; the last one kills
an engine. Each test waits for the pods' heartbeats to say "idle" before it starts, so the
router's decisions depend only on what the test itself sends.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import httpx
import pytest
import redis
from waiting import wait_until

from .router_fixtures import MODEL, Cluster, metric_sum, scrape, start_cluster

pytestmark = pytest.mark.slow

BLOCK = 16
ENGINE_ARGS = ("--num-kv-blocks", "96", "--max-model-len", "1024", "--max-num-seqs", "8")
GUARD = 8                # PolicyConfig.guard_threshold, the router's default
SHARED_BLOCKS = 6        # full blocks every prompt of a family shares (system prompt + template)


def system_prompt(company: str, product: str) -> str:
    """A distinct ~100-token system prompt (6 full blocks with the chat template): the company
    name comes first, so the families differ from block 0 on."""
    return (f"{company} support desk. You are the assistant of {company}, which sells {product}. "
            f"Answer questions about {product} politely and briefly. Never reveal internal "
            f"prices, never promise delivery dates, and always suggest the {company} help "
            f"center for billing problems. If a customer is angry, apologise once, then give "
            f"concrete steps. Refuse anything unrelated to {product}. Keep every answer under "
            f"three sentences and do not use lists unless the customer asks for one.")


FAMILIES = {
    "alpha": system_prompt("Alphacorp", "garden tools"),
    "bravo": system_prompt("Bravo Telecom", "mobile phone plans"),
    "charlie": system_prompt("Charlie Airlines", "flight tickets"),
}
HOT = system_prompt("Hotel Delta", "hotel rooms")
LATE = system_prompt("Echo Bank", "savings accounts")      # first sent after the Redis restart
VICTIM_FAMILY = system_prompt("Foxtrot Cars", "used cars")


# ---- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("router-e2e"), 3, engine_args=ENGINE_ARGS)
    yield c
    codes = c.stop()
    assert codes[0] == 0, f"router exit code {codes[0]}"      # a clean SIGTERM exits 0
    # every engine the tests did not SIGKILL shut down cleanly on SIGTERM
    assert [code for e, code in zip(c.engines, codes[1:]) if not e.killed] == \
        [0] * sum(not e.killed for e in c.engines), codes


@pytest.fixture
def client(cluster):
    from openai import OpenAI
    return OpenAI(base_url=f"{cluster.router.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def aclient(cluster):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=f"{cluster.router.url}/v1", api_key="none", max_retries=0,
                       timeout=120)


def messages(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclass
class Reply:
    backend: str | None = None   # x-kvmesh-backend
    reason: str | None = None    # x-kvmesh-route-reason
    tokens: int = 0              # completion tokens (from the usage chunk)
    cached: int = 0              # prompt tokens served by the engine's prefix cache
    finish: str | None = None
    error: str | None = None
    sent_at: float = 0.0         # time.monotonic() when the request left the client
    first_token_at: float | None = None
    done_at: float = 0.0


def chat(client, system: str, user: str, max_tokens: int = 4) -> Reply:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(system, user), max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})
    body = raw.parse()
    return Reply(raw.headers.get("x-kvmesh-backend"), raw.headers.get("x-kvmesh-route-reason"),
                 body.usage.completion_tokens, body.usage.prompt_tokens_details.cached_tokens,
                 body.choices[0].finish_reason)


async def stream_chat(aclient, system: str, user: str, max_tokens: int, delay: float = 0.0,
                      started: asyncio.Event | None = None) -> Reply:
    """One streaming request after `delay` s; never raises (a failure is in `error`)."""
    await asyncio.sleep(delay)
    r = Reply(sent_at=time.monotonic())
    try:
        raw = await aclient.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages(system, user), max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        r.backend = raw.headers.get("x-kvmesh-backend")
        r.reason = raw.headers.get("x-kvmesh-route-reason")
        async for chunk in raw.parse():     # NOTE: the legacy raw wrapper parses synchronously
            if chunk.choices:
                c = chunk.choices[0]
                if c.delta.content and r.first_token_at is None:
                    r.first_token_at = time.monotonic()
                    if started is not None:
                        started.set()
                r.finish = c.finish_reason or r.finish
            if chunk.usage is not None:
                r.tokens = chunk.usage.completion_tokens
                r.cached = chunk.usage.prompt_tokens_details.cached_tokens
    except Exception as e:  # noqa: BLE001 - the tests assert on it
        r.error = f"{type(e).__name__}: {e}"
    r.done_at = time.monotonic()
    return r


def complete(r: Reply, max_tokens: int) -> bool:
    return r.error is None and r.tokens == max_tokens and r.finish == "length"


def _redis(cluster: Cluster) -> redis.Redis:
    return redis.Redis(port=cluster.redis.port, decode_responses=True, socket_timeout=2)


def wait_idle(cluster: Cluster, timeout: float = 60.0) -> None:
    """Until every live pod's heartbeat says running = waiting = 0 and its KV events are in
    Redis, plus one router refresh (250 ms), so routing starts from a known state."""
    client = _redis(cluster)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            pods = [client.hgetall(k) for k in client.keys("*:pod:*")]
            live = [e for e in cluster.engines if e.alive()]
            if len(pods) == len(live) and all(p.get("running") == "0" and p.get("waiting") == "0"
                                              for p in pods):
                time.sleep(1.2)      # NOTE: one more heartbeat (1 s) and one router refresh
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError("pods never became idle")


def prefix_hits(cluster: Cluster) -> dict[str, float]:
    return {e.url: metric_sum(scrape(e.url), "kvmesh:prefix_cache_hits_total")
            for e in cluster.engines if e.alive()}


def router_metric(cluster: Cluster, name: str, **labels: str) -> float:
    return metric_sum(scrape(cluster.router.url), name, **labels)


def engine_metric(engine, name: str, **labels: str) -> float:
    return metric_sum(scrape(engine.url), name, **labels)


# NOTE: the cluster's endpoints are polled every 0.1 s, not the default 0.02 s: three engines
# share two cores with the test.
wait_for = functools.partial(wait_until, interval=0.1)


# ---- (a) prefix families ----------------------------------------------------------------------
def test_the_router_serves_the_engines_tokenize_and_detokenize(cluster):
    body = {"messages": messages(FAMILIES["alpha"], "Hi"), "add_generation_prompt": True}
    want = httpx.post(f"{cluster.engines[0].url}/tokenize", json=body).json()
    got = httpx.post(f"{cluster.router.url}/tokenize", json=body)
    assert got.status_code == 200 and got.json() == want and want["count"] > 0
    text = httpx.post(f"{cluster.engines[0].url}/detokenize",
                      json={"tokens": want["tokens"]}).json()
    got = httpx.post(f"{cluster.router.url}/detokenize", json={"tokens": want["tokens"]})
    assert got.json() == text and FAMILIES["alpha"] in text["prompt"]
    bad = httpx.post(f"{cluster.router.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "error" in bad.json()     # the engine's error, passed on


def test_each_prefix_family_goes_to_the_pod_that_holds_it(cluster, client):
    wait_idle(cluster)
    holders: dict[str, str] = {}
    for name, system in FAMILIES.items():
        r = chat(client, system, "Hello, who are you?")
        assert r.reason == "no-prefix" and r.cached == 0, r
        holders[name] = r.backend
        wait_idle(cluster)
    # cold prompts on idle pods tie; the tie-break rotates, so the three families land apart
    assert sorted(holders.values()) == sorted(e.url for e in cluster.engines)

    before = prefix_hits(cluster)
    expected = defaultdict(int)
    for i in range(3):
        for name, system in FAMILIES.items():
            r = chat(client, system, f"Question {i}: how do I get a refund?")
            assert (r.backend, r.reason) == (holders[name], "prefix-hit"), (name, r)
            assert r.cached >= SHARED_BLOCKS * BLOCK and r.cached % BLOCK == 0, r
            expected[r.backend] += r.cached
    after = prefix_hits(cluster)
    # exact: each engine's prefix-cache hit counter grew by the cached tokens of the requests the
    # router sent to it, and by nothing else
    assert {u: after[u] - before[u] for u in after} == {u: float(expected[u]) for u in after}


# ---- (b) one hot prefix, a burst --------------------------------------------------------------
async def test_a_hot_prefix_burst_spills_over_when_its_pod_is_saturated(cluster, client, aclient):
    wait_idle(cluster)
    holder = chat(client, HOT, "Do you have a room tonight?").backend
    wait_idle(cluster)
    n, max_tokens = 24, 32
    replies = await asyncio.gather(*(stream_chat(aclient, HOT, f"Guest {i}: is breakfast "
                                                  "included?", max_tokens) for i in range(n)))
    assert all(complete(r, max_tokens) for r in replies), [r for r in replies
                                                          if not complete(r, max_tokens)]
    per_pod = Counter(r.backend for r in replies)
    reasons = Counter(r.reason for r in replies)
    assert len(per_pod) >= 2, per_pod                       # it spread
    assert reasons["load-guard"] >= 1, reasons               # because of the load guard
    # the holder fills up to the guard threshold before anything spills
    assert per_pod[holder] >= GUARD + 1, (holder, per_pod)
    assert set(reasons) <= {"prefix-hit", "load-guard"}, reasons
    # the spill pods prefilled the prefix themselves; the holder served it from cache
    assert all(r.cached >= SHARED_BLOCKS * BLOCK for r in replies if r.backend == holder)


# ---- (c) Redis killed mid-run ------------------------------------------------------------------
async def test_redis_killed_mid_run_loses_no_request_and_routing_resumes(cluster, client,
                                                                          aclient):
    wait_idle(cluster)
    max_tokens = 16
    systems = list(FAMILIES.values())
    before = [stream_chat(aclient, systems[i % 3], f"Before {i}: where is my order?", max_tokens,
                          delay=0.15 * i) for i in range(9)]
    first = asyncio.gather(*before)
    await asyncio.sleep(0.8)                 # a batch is in flight and more are being sent
    cluster.redis.stop()
    killed_at = time.monotonic()
    after = [stream_chat(aclient, systems[i % 3], f"After {i}: where is my order?", max_tokens,
                         delay=0.25 * i) for i in range(9)]
    replies = await first + await asyncio.gather(*after)
    # the kill landed mid-run: requests were in flight, and the first batch was still being sent
    assert any(r.sent_at < killed_at < r.done_at for r in replies)
    assert any(r.sent_at > killed_at for r in replies[:9])
    bad = [r for r in replies if not complete(r, max_tokens)]
    assert not bad, bad                      # no request failed
    late = [r for r in replies if r.sent_at > killed_at + 1.0]
    assert len(late) >= 4
    assert {r.reason for r in late} == {"fallback-no-redis"}, [r.reason for r in late]
    assert router_metric(cluster, "kvmesh_router_redis_up") == 0
    assert router_metric(cluster, "kvmesh_router_fallbacks_total") >= len(late)
    # each engine kept serving and says so on its /metrics
    for e in cluster.engines:
        assert wait_for(lambda: engine_metric(e, "kvmesh:kv_index_connected") == 0, timeout=5)
        assert engine_metric(e, "kvmesh:kv_index_redis_errors_total") >= 1

    # an empty Redis comes back: the engines resync their caches, the router reads heartbeats
    cluster.redis.start()
    r_client = _redis(cluster)
    try:
        assert wait_for(lambda: len(r_client.keys("*:podblk:*")) == 3
                        and len(r_client.keys("*:pod:*")) == 3, timeout=20)
    finally:
        r_client.close()
    assert wait_for(lambda: httpx.get(f"{cluster.router.url}/ready").json()["redis"], timeout=5)
    wait_idle(cluster)
    # the resynced index still knows every family (the snapshot), ...
    for name, system in FAMILIES.items():
        r = chat(client, system, "Back again: can I change my address?")
        assert r.reason == "prefix-hit" and r.cached >= SHARED_BLOCKS * BLOCK, (name, r)
    # ... and a prefix first seen after the restart is routed by the index as well
    wait_idle(cluster)
    first_late = chat(client, LATE, "What is the interest rate?")
    assert first_late.reason == "no-prefix"
    wait_idle(cluster)
    for i in range(2):
        r = chat(client, LATE, f"Question {i}: can I open an account online?")
        assert (r.backend, r.reason) == (first_late.backend, "prefix-hit"), r
    assert router_metric(cluster, "kvmesh_router_redis_up") == 1
    for e in cluster.engines:
        assert engine_metric(e, "kvmesh:kv_index_connected") == 1
        assert engine_metric(e, "kvmesh:kv_index_resyncs_total") >= 1


# ---- (d) an engine SIGKILLed mid-run -----------------------------------------------------------
async def test_an_engine_killed_mid_run_is_routed_around(cluster, client, aclient):
    wait_idle(cluster)
    victim_url = chat(client, VICTIM_FAMILY, "Do you sell electric cars?").backend
    victim = cluster.engine_by_url(victim_url)
    wait_idle(cluster)
    max_tokens = 24
    others = list(FAMILIES.values())
    started = asyncio.Event()
    # in flight when the kill lands: 4 on the victim (its prefix), 4 elsewhere or anywhere
    first = [stream_chat(aclient, VICTIM_FAMILY, f"Early {i}: what about mileage?", max_tokens,
                         delay=0.05 * i, started=started) for i in range(4)]
    first += [stream_chat(aclient, others[i % 3], f"Early {i}: opening hours?", max_tokens,
                          delay=0.05 * i) for i in range(4)]
    batch1 = asyncio.gather(*first)
    await asyncio.wait_for(started.wait(), 60)        # the victim is streaming
    victim.kill()
    killed_at = time.monotonic()
    second = [stream_chat(aclient, VICTIM_FAMILY if i % 2 else others[i % 3],
                          f"Late {i}: any discounts?", max_tokens, delay=0.1 * i)
              for i in range(10)]
    batch2 = asyncio.gather(*second)
    # the router's /metrics shows the victim unhealthy within a few seconds
    assert await asyncio.to_thread(wait_for, lambda: router_metric(
        cluster, "kvmesh_router_backend_healthy", backend=victim_url) == 0, 3.0)
    detected_in = time.monotonic() - killed_at
    replies1, replies2 = await batch1, await batch2

    on_victim = [r for r in replies1 if r.backend == victim_url]
    assert on_victim, "no request was streaming on the victim when it died"
    # every request that had not started streaming on the victim completed via the others, or
    # (sent to the victim as it died: it may have received it) got a 502 and was not re-sent
    bad = [r for r in replies1 + replies2
           if r.backend != victim_url and not complete(r, max_tokens)
           and not (r.error and "502" in r.error and "not retried" in r.error)]
    assert not bad, bad
    # new requests never went to it (a first attempt that hit the dead port was re-sent)
    assert all(r.backend != victim_url for r in replies2), replies2
    assert {r.backend for r in replies2} <= {e.url for e in cluster.engines if e.alive()}
    assert detected_in < 3.0
    # and it stays out: the health loop keeps it unhealthy
    await asyncio.sleep(1.5)
    assert router_metric(cluster, "kvmesh_router_backend_healthy", backend=victim_url) == 0
    r = chat(client, VICTIM_FAMILY, "Still there?")
    assert r.backend != victim_url and r.tokens == 4
