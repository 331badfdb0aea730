"""The publisher under Redis faults (issue 12): a hung Redis never stalls a step, and a lapsed
heartbeat whose entries another pod purged is followed by a full resync."""
from __future__ import annotations

import time

import pytest

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.index.layout import PURGE_DEAD_PODS, KeySpace
from kvmesh.index.publisher import KVEventPublisher, publish_engine_state

from index_helpers import NS, SVC, h, wait_until
from processes import Blackhole

MODEL = "m"


@pytest.fixture
def blackhole():
    b = Blackhole()
    yield b
    b.close()


def test_a_hung_redis_never_stalls_a_step_and_close_is_bounded(smollm, blackhole):
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=128), loaded=smollm)
    pub = KVEventPublisher(blackhole.url, "p0", MODEL, "http://p0", NS, SVC,
                           flush_interval_s=0.01, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0,
                           snapshot_fn=engine.cached_blocks)
    publish_engine_state(pub, engine)
    on_step, observer_times = pub.on_step, []

    def timed(report):
        t0 = time.monotonic()
        on_step(report)
        observer_times.append(time.monotonic() - t0)
    pub.on_step = timed
    engine.add_observer(pub)
    engine.add_request("a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4,
                                                                  ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # NOTE: the publisher's thread is stuck on 1 s socket timeouts all along; the step's share
    # of publishing is an append under a lock.
    assert len(observer_times) == 4 and max(observer_times) < 0.05
    t0 = time.monotonic()
    assert pub.flush(timeout=0.5) is False
    assert time.monotonic() - t0 < 1.5                     # flush gives up at its timeout
    assert not pub.connected
    t0 = time.monotonic()
    pub.close(timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + 1.0 + 1.0         # join timeout + one socket timeout


def test_a_lapsed_heartbeat_that_was_purged_is_followed_by_a_full_resync(redis_server):
    held = [(h(i), "gpu") for i in range(5)]
    pub = KVEventPublisher(redis_server.url, "p0", MODEL, "http://p0", NS, SVC,
                           flush_interval_s=0.01, heartbeat_interval_s=0.1, heartbeat_ttl_s=5.0,
                           snapshot_fn=lambda: held)
    keys = KeySpace(NS, SVC)
    client = redis_server.client()
    try:
        assert pub.flush(10)
        assert len(client.smembers(keys.pod_blocks("p0"))) == 5
        # the heartbeat lapses and another pod's purge removes this pod's entries (atomically,
        # so the publisher cannot refresh in between)
        purge = client.register_script(PURGE_DEAD_PODS)
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.pod("p0"))
        purge(keys=[keys.pods], args=[keys.prefix], client=pipe)
        assert pipe.execute()[1] == ["p0"]
        assert wait_until(lambda: len(client.smembers(keys.pod_blocks("p0"))) == 5, timeout=10)
        assert pub.heartbeat_lapses >= 1
        assert all(client.sismember(keys.block(MODEL, b.hex()), "p0|gpu") for b, _ in held)
    finally:
        pub.close()
        client.close()
