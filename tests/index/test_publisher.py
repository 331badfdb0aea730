"""KVEventPublisher -> Redis -> PrefixIndex round trips against a real redis-server."""
from __future__ import annotations

import logging
import random
import threading

import pytest

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSequencer
from kvmesh.index.layout import KeySpace
from kvmesh.index.publisher import KVEventPublisher

from index_helpers import NS, SVC, h, index_call, wait_until

MODEL = "m"


def make_publisher(server, pod: str, **kw) -> KVEventPublisher:
    kw.setdefault("flush_interval_s", 0.01)
    kw.setdefault("heartbeat_interval_s", 0.2)
    kw.setdefault("heartbeat_ttl_s", 2.0)
    return KVEventPublisher(server.url, pod, MODEL, f"http://{pod}:8000", NS, SVC, **kw)


class FakePod:
    """What one engine holds, plus its event sequencer: the model the index must equal."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.held: set[bytes] = set()
        self.seq = KVEventSequencer()

    def snapshot(self):
        return [(x, "gpu") for x in list(self.held)]

    def random_batch(self, universe: int = 40):
        events = []
        for _ in range(self.rng.randint(1, 4)):
            r = self.rng.random()
            if r < 0.03:
                self.held.clear()
                events.append(AllBlocksCleared())
            elif r < 0.6 or not self.held:
                new = [h(self.rng.randrange(universe)) for _ in range(self.rng.randint(1, 5))]
                new = [x for x in dict.fromkeys(new) if x not in self.held]
                if new:
                    self.held.update(new)
                    events.append(BlockStored(new, None, [1] * 4 * len(new), 4))
            else:
                gone = self.rng.sample(sorted(self.held), self.rng.randint(1, len(self.held)))
                self.held.difference_update(gone)
                events.append(BlockRemoved(gone))
        return self.seq.batch(events)


def expected(pods: dict[str, FakePod]) -> dict[str, set[bytes]]:
    return {name: set(p.held) for name, p in pods.items() if p.held}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_event_stream_from_two_pods_matches_index_exactly(redis_server, seed):
    rng = random.Random(seed)
    pods = {name: FakePod(rng) for name in ("pod-a", "pod-b")}
    pubs = {name: make_publisher(redis_server, name, snapshot_fn=p.snapshot)
            for name, p in pods.items()}
    try:
        for step in range(80):
            name = rng.choice(sorted(pods))
            pubs[name].publish(pods[name].random_batch())
            if step % 20 == 19:
                assert all(p.flush() for p in pubs.values())
                assert index_call(redis_server.url, "dump", MODEL) == expected(pods)
        assert all(p.flush() for p in pubs.values())
        assert index_call(redis_server.url, "dump", MODEL) == expected(pods)
        # the per-pod sets are exact too: they are what a clear deletes
        client = redis_server.client()
        keys = KeySpace(NS, SVC)
        for name, pod in pods.items():
            members = client.smembers(keys.pod_blocks(name))
            assert members == {f"gpu|{MODEL}|{x.hex()}" for x in pod.held}
        assert all(p.resyncs == 1 and p.redis_errors == 0 for p in pubs.values())
    finally:
        for p in pubs.values():
            p.close()


def test_lookup_counts_consecutive_blocks_from_block_zero(redis_server):
    a, b = make_publisher(redis_server, "pod-a"), make_publisher(redis_server, "pod-b")
    seq_a, seq_b = KVEventSequencer(), KVEventSequencer()
    try:
        chain = [h(f"c{i}") for i in range(6)]
        a.publish(seq_a.batch([BlockStored(chain[:4], None, [0] * 16, 4)]))
        # pod-b holds blocks 0, 1 and 3..5: its run stops at the missing block 2
        b.publish(seq_b.batch([BlockStored(chain[:2] + chain[3:], None, [0] * 20, 4)]))
        assert a.flush() and b.flush()
        assert index_call(redis_server.url, "lookup", MODEL, chain) == {"pod-a": 4, "pod-b": 2}
        assert index_call(redis_server.url, "lookup", MODEL, chain[1:]) == {"pod-a": 3, "pod-b": 1}
        assert index_call(redis_server.url, "lookup", MODEL, [h("x")] + chain) == {}
        assert index_call(redis_server.url, "lookup", "other-model", chain) == {}
        assert index_call(redis_server.url, "lookup", MODEL, []) == {}
        live = index_call(redis_server.url, "live_pods")
        assert set(live) == {"pod-a", "pod-b"}
        assert live["pod-a"].url == "http://pod-a:8000" and live["pod-a"].model == MODEL
    finally:
        a.close()
        b.close()


def test_start_clears_old_entries_and_close_clears_everything(redis_server):
    first = make_publisher(redis_server, "pod-a")
    first.publish(KVEventSequencer().batch([BlockStored([h(1), h(2)], None, [0] * 8, 4)]))
    first.update_load(3, 1, 0, 0.5)
    assert first.flush()
    assert index_call(redis_server.url, "dump", MODEL) == {"pod-a": {h(1), h(2)}}
    first.close(clear=False)          # a crash: entries stay behind
    assert index_call(redis_server.url, "dump", MODEL) == {"pod-a": {h(1), h(2)}}

    again = make_publisher(redis_server, "pod-a", snapshot_fn=lambda: [(h(9), "gpu")])
    assert again.flush()
    assert index_call(redis_server.url, "dump", MODEL) == {"pod-a": {h(9)}}
    live = index_call(redis_server.url, "live_pods")["pod-a"]
    assert (live.running, live.waiting, live.kv_usage) == (0, 0, 0.0)
    again.update_load(3, 1, 2, 0.5)
    assert wait_until(lambda: index_call(redis_server.url, "live_pods")["pod-a"].running == 3)
    live = index_call(redis_server.url, "live_pods")["pod-a"]
    assert (live.running, live.waiting, live.swapped, live.kv_usage) == (3, 1, 2, 0.5)

    again.close()
    assert index_call(redis_server.url, "dump", MODEL) == {}
    assert index_call(redis_server.url, "live_pods") == {}
    keys = KeySpace(NS, SVC)
    assert [k for k in redis_server.client().keys("*") if k.startswith(keys.prefix)] == []


def test_dead_pod_drops_out_when_its_heartbeat_expires(redis_server):
    chain = [h(f"d{i}") for i in range(3)]
    a = make_publisher(redis_server, "pod-a", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5)
    b = make_publisher(redis_server, "pod-b", heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5)
    try:
        for p in (a, b):
            p.publish(KVEventSequencer().batch([BlockStored(chain, None, [0] * 12, 4)]))
            assert p.flush()
        assert index_call(redis_server.url, "lookup", MODEL, chain) == {"pod-a": 3, "pod-b": 3}
        a.close(clear=False)          # dies without cleanup
        assert wait_until(lambda: index_call(redis_server.url, "lookup", MODEL, chain)
                          == {"pod-b": 3}, timeout=3)
        assert set(index_call(redis_server.url, "live_pods")) == {"pod-b"}
        # the janitor of a live publisher deletes the dead pod's entries for good
        assert wait_until(lambda: index_call(redis_server.url, "dump", MODEL)
                          == {"pod-b": set(chain)}, timeout=3)
        b.close(clear=False)
        assert wait_until(lambda: index_call(redis_server.url, "live_pods") == {}, timeout=3)
        assert index_call(redis_server.url, "lookup", MODEL, chain) == {}
        assert "pod-b" in index_call(redis_server.url, "dump", MODEL)
        # ... and so does the router's
        assert index_call(redis_server.url, "purge_dead_pods") == ["pod-b"]
        assert index_call(redis_server.url, "dump", MODEL) == {}
    finally:
        b.close()


def _publish_with_deadline(pub, batch, timeout: float = 1.0) -> None:
    t = threading.Thread(target=pub.publish, args=(batch,), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "publish blocked while Redis was down"


def test_redis_outage_logs_once_keeps_accepting_and_resyncs(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="kvmesh.index.publisher")
    rng = random.Random(7)
    pod = FakePod(rng)
    pub = make_publisher(redis_server, "pod-a", snapshot_fn=pod.snapshot)
    try:
        for _ in range(10):
            pub.publish(pod.random_batch())
        assert pub.flush()
        assert pub.connected and pub.redis_errors == 0

        redis_server.stop()
        for _ in range(30):
            _publish_with_deadline(pub, pod.random_batch())
        assert wait_until(lambda: not pub.connected and pub.redis_errors >= 3, timeout=5)
        for _ in range(10):
            _publish_with_deadline(pub, pod.random_batch())
        assert not pub.flush(timeout=0.2)
        outage = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(outage) == 1 and outage[0].levelno == logging.WARNING

        redis_server.start()          # empty: no persistence
        assert pub.flush(timeout=10)
        assert pub.connected and pub.resyncs >= 2
        assert index_call(redis_server.url, "dump", MODEL) == ({"pod-a": pod.held} if pod.held
                                                                else {})
        for _ in range(10):
            pub.publish(pod.random_batch())
        assert pub.flush()
        assert index_call(redis_server.url, "dump", MODEL) == ({"pod-a": pod.held} if pod.held
                                                                else {})
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        pub.close()


def test_queue_overflow_and_sequence_gaps_trigger_a_resync(redis_server):
    pod = FakePod(random.Random(3))
    pub = make_publisher(redis_server, "pod-a", snapshot_fn=pod.snapshot, max_queue=3,
                         start=False)
    try:
        for _ in range(10):
            pub.publish(pod.random_batch())
        assert pub.batches_dropped == 7 and pub.queue_len == 3
        pub.start()
        assert pub.flush()
        assert index_call(redis_server.url, "dump", MODEL) == ({"pod-a": pod.held} if pod.held
                                                                else {})
        pub.publish(pod.random_batch())
        assert pub.flush()
        resyncs = pub.resyncs
        pod.held.clear()
        pod.seq.batch([AllBlocksCleared()])       # numbered but lost before the publisher
        pod.held.add(h("late"))
        pub.publish(pod.seq.batch([BlockStored([h("late")], None, [0] * 4, 4)]))
        assert pub.flush()
        assert pub.resyncs == resyncs + 1
        assert index_call(redis_server.url, "dump", MODEL) == {"pod-a": pod.held}
    finally:
        pub.close()


def test_config_errors_are_explicit(redis_server):
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        make_publisher(redis_server, "p", heartbeat_interval_s=1.0, heartbeat_ttl_s=1.0)
    with pytest.raises(ValueError, match="pod_id"):
        make_publisher(redis_server, "")
