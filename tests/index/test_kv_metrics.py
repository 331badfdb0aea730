"""The remote-KV and index-publisher counters on /metrics move under the faults that drive them:
a real Redis (hits, misses, stores), a Redis that accepts and never answers (errors, the circuit
breaker, skipped prefetches), a publisher whose queue overflows or whose heartbeat lapses."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.index.breaker import CircuitBreaker
from kvmesh.common.kv_events import BlockStored, KVEventBatch
from kvmesh.index.kv_bytes import RedisKVStore
from kvmesh.index.layout import PURGE_DEAD_PODS, KeySpace
from kvmesh.index.metrics import KVShareCollector, PublisherCollector
from kvmesh.index.publisher import KVEventPublisher

from index_helpers import NS, SVC, h, wait_until
from processes import Blackhole

LAYOUT = (2, 4)                  # 8 bytes a block


def scrape(collector) -> dict[str, float]:
    """/metrics as the server renders it: {sample name: value} for model "m"."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return {s.name: s.value for fam in text_string_to_metric_families(generate_latest(registry)
                                                                      .decode())
            for s in fam.samples if s.labels == {"model_name": "m"}}


@pytest.fixture
def blackhole():
    b = Blackhole()
    yield b
    b.close()


def test_kv_share_counts_stores_prefetch_hits_and_misses(redis_server):
    a = RedisKVStore(redis_server.url, "fp", "float32", LAYOUT, NS, SVC)
    b = RedisKVStore(redis_server.url, "fp", "float32", LAYOUT, NS, SVC)
    try:
        a.save(h(1), b"x" * 8)
        a.flush()
        b.prefetch("hit", [h(1), h(2)])
        assert b.settle(10)
        b.prefetch("miss", [h(3)])
        assert b.settle(10)
        assert b.lookup("hit", [h(1), h(2)]) == [b"x" * 8]
        assert scrape(KVShareCollector(a, "m"))["kvmesh:kv_share_blocks_stored_total"] == 1
        got = scrape(KVShareCollector(b, "m"))
        assert {k: v for k, v in got.items() if "prefetch" in k} == {
            "kvmesh:kv_share_prefetches_started_total": 2, "kvmesh:kv_share_prefetch_hits_total": 1,
            "kvmesh:kv_share_prefetch_misses_total": 1,
            "kvmesh:kv_share_prefetches_skipped_total": 0}
        assert got["kvmesh:kv_share_breaker_open"] == 0
    finally:
        a.close()
        b.close()


def test_kv_share_breaker_opens_on_a_hung_redis_and_later_prefetches_are_skipped(blackhole):
    store = RedisKVStore(blackhole.url, "fp", "float32", LAYOUT, NS, SVC, socket_timeout_s=0.2,
                         breaker=CircuitBreaker("KV sharing", failures=1, cooldown_s=60))
    try:
        store.prefetch("r1", [h(1)])
        assert store.settle(10)                       # one MGET timed out: the breaker opened
        store.prefetch("r2", [h(2)])                  # skipped at once, never queued
        store.save(h(3), b"y" * 8)                    # dropped by the writer: breaker open
        store.flush()
        got = scrape(KVShareCollector(store, "m"))
        assert {k: got[k] for k in (
            "kvmesh:kv_share_breaker_open", "kvmesh:kv_share_breaker_opens_total",
            "kvmesh:kv_share_prefetches_started_total", "kvmesh:kv_share_prefetch_misses_total",
            "kvmesh:kv_share_prefetches_skipped_total", "kvmesh:kv_share_redis_errors_total",
            "kvmesh:kv_share_stores_dropped_total", "kvmesh:kv_share_prefetch_hits_total")} == {
            "kvmesh:kv_share_breaker_open": 1, "kvmesh:kv_share_breaker_opens_total": 1,
            "kvmesh:kv_share_prefetches_started_total": 1,
            "kvmesh:kv_share_prefetch_misses_total": 1,
            "kvmesh:kv_share_prefetches_skipped_total": 1, "kvmesh:kv_share_redis_errors_total": 1,
            "kvmesh:kv_share_stores_dropped_total": 1, "kvmesh:kv_share_prefetch_hits_total": 0}
    finally:
        store.close()


def test_publisher_counts_batches_dropped_on_a_full_queue(blackhole):
    # NOTE: the thread is not started: nothing drains the queue, as with a Redis that hangs
    pub = KVEventPublisher(blackhole.url, "p0", "m", "http://p0", NS, SVC, max_queue=1,
                           start=False)
    try:
        for seq in range(3):
            pub.publish(KVEventBatch(seq, 0.0, [BlockStored([h(seq)], None, [1, 2], 2)]))
        got = scrape(PublisherCollector(pub, "m"))
        assert got["kvmesh:kv_index_batches_dropped_total"] == 2
        assert got["kvmesh:kv_index_connected"] == 0
    finally:
        pub.close(clear=False, timeout=0.1)


def test_publisher_counts_a_lapsed_heartbeat_and_the_resync_after_it(redis_server):
    pub = KVEventPublisher(redis_server.url, "p0", "m", "http://p0", NS, SVC,
                           flush_interval_s=0.01, heartbeat_interval_s=0.1, heartbeat_ttl_s=5.0,
                           snapshot_fn=lambda: [(h(0), "gpu")])
    keys = KeySpace(NS, SVC)
    client = redis_server.client()
    try:
        assert pub.flush(10)
        before = scrape(PublisherCollector(pub, "m"))
        assert (before["kvmesh:kv_index_resyncs_total"],
                before["kvmesh:kv_index_heartbeat_lapses_total"]) == (1, 0)
        pipe = client.pipeline(transaction=True)       # the lapse and another pod's purge
        pipe.delete(keys.pod("p0"))
        client.register_script(PURGE_DEAD_PODS)(keys=[keys.pods], args=[keys.prefix], client=pipe)
        pipe.execute()
        assert wait_until(lambda: pub.resyncs == 2, timeout=10)
        after = scrape(PublisherCollector(pub, "m"))
        assert (after["kvmesh:kv_index_resyncs_total"],
                after["kvmesh:kv_index_heartbeat_lapses_total"]) == (2, 1)
    finally:
        pub.close()
        client.close()
