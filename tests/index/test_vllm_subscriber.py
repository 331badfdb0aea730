"""The router's subscriber for a vLLM engine's KV events writes kvmesh's own hashes of the events'
tokens into the shared Redis index; gaps are replayed; a silent or unhealthy engine's entries
expire; a restart, a reset and blocks kvmesh cannot hash are handled. A real redis-server and a
publisher written by the test from vLLM's format (tests/support/fake_vllm.py)."""
from __future__ import annotations

import pytest

from kvmesh.index.hashing import prompt_block_hashes
from kvmesh.index.vllm_subscriber import IndexTarget, VllmEventSubscriber, VllmSource

from fake_vllm import FakeVllmPublisher, VCleared, VRemoved, VStored
from index_helpers import NS, SVC, index_call
from waiting import wait_until

MODEL = "m"
BS = 4
POD = "127.0.0.1:8001"
PROMPT = list(range(100, 114))             # 3 full blocks of 4, then 2 tokens
TENANT = "tenant-a"


@pytest.fixture
def pub():
    p = FakeVllmPublisher()
    yield p
    p.close()


def subscriber(pub: FakeVllmPublisher, redis_url: str, replay: bool = True,
               ttl: float = 5.0) -> VllmEventSubscriber:
    source = VllmSource(POD, "http://127.0.0.1:8001", f"tcp://127.0.0.1:{pub.pub_port}",
                        f"tcp://127.0.0.1:{pub.replay_port}" if replay else None, "kv-events")
    return VllmEventSubscriber(source, IndexTarget(redis_url, MODEL, BS, "kvmesh", NS, SVC),
                               heartbeat_interval_s=0.1, heartbeat_ttl_s=ttl,
                               probe_interval_s=0.1)


def lookup(url: str, tokens: list[int], salt: str | None = None) -> dict[str, int]:
    return index_call(url, "lookup", MODEL, prompt_block_hashes(tokens, BS, "kvmesh", salt))


def stored(hashes, parent, tokens, **kw) -> VStored:
    return VStored(hashes, parent, tokens, BS, **kw)


def test_events_become_kvmesh_hashes_in_the_index(pub, redis_server):
    sub = subscriber(pub, redis_server.url)
    try:
        assert wait_until(lambda: pub.replay_requests == [0] or 0 in pub.replay_requests)
        # engine hashes are arbitrary: 9001.. have nothing to do with kvmesh's hashes
        pub.send(stored([9001, 9002], None, PROMPT[:8]))
        pub.send(stored([9003], 9002, PROMPT[8:12]))
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 3}, timeout=5)
        want = set(prompt_block_hashes(PROMPT, BS, "kvmesh"))
        assert index_call(redis_server.url, "dump", MODEL) == {POD: want}

        # a salted chain (vLLM publishes the cache salt as block 0's extra key)
        pub.send(stored([7001, 7002], None, PROMPT[:8], extra_keys=[[TENANT], None]))
        assert wait_until(lambda: lookup(redis_server.url, PROMPT, TENANT) == {POD: 2})
        # blocks kvmesh's hash cannot express are left out, never written wrong
        pub.send(stored([6001], None, PROMPT[:4], lora_id=3))            # an adapter without a name
        pub.send(stored([6002], None, PROMPT[:4], extra_keys=[[["mm", "img0", 0]]]))
        pub.send(VStored([6003], None, PROMPT[:8], 8))                   # another block size
        pub.send(stored([6004], 424242, PROMPT[:4]))                     # unknown parent
        assert wait_until(lambda: sub.skipped_blocks == 4)
        # a named adapter's blocks are indexed under the adapter: only its lookups match them
        pub.send(stored([5001, 5002], None, PROMPT[:8], lora_id=3, lora_name="ad",
                        extra_keys=[["ad"], ["ad"]]))
        ad = prompt_block_hashes(PROMPT, BS, "kvmesh", lora_name="ad")
        assert wait_until(lambda: index_call(redis_server.url, "lookup", MODEL, ad) == {POD: 2})
        assert lookup(redis_server.url, PROMPT) == {POD: 3} and sub.skipped_blocks == 4

        pub.send(VRemoved([9003, 12345]))                  # 12345: never stored, ignored
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 2})
        pub.send(VCleared())
        assert wait_until(lambda: index_call(redis_server.url, "dump", MODEL) == {})
        assert sub.lost_batches == 0 and sub.decode_errors == 0 and sub.replays == 0
        live = index_call(redis_server.url, "live_pods")
        assert live[POD].url == "http://127.0.0.1:8001" and live[POD].model == MODEL
    finally:
        sub.stop()
    assert index_call(redis_server.url, "live_pods") == {}


def test_buffered_history_is_read_at_start_and_a_gap_is_replayed(pub, redis_server):
    # stored before the router came: only the replay buffer has it
    pub.send(stored([1, 2], None, PROMPT[:8]), deliver=False)
    sub = subscriber(pub, redis_server.url)
    try:
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 2})
        pub.send(stored([3], 2, PROMPT[8:12]), deliver=False)       # seq 1: lost on the wire
        pub.send(VRemoved([1]), deliver=False, buffer=False)         # seq 2: lost for good
        pub.send(stored([9], None, [7, 7, 7, 7]))                    # seq 3 shows the gap
        assert wait_until(lambda: sub.lost_batches == 1)
        # (a probe, which asks from the next number too, may have fetched it first)
        assert 1 in pub.replay_requests
        # seq 1 came by replay; seq 2 (a removal) is lost, so block 0 stays listed
        assert lookup(redis_server.url, PROMPT) == {POD: 3}
        assert lookup(redis_server.url, [7, 7, 7, 7]) == {POD: 1}
    finally:
        sub.stop()


def test_a_silent_publisher_or_an_unhealthy_backend_has_its_entries_expire(pub, redis_server):
    sub = subscriber(pub, redis_server.url, ttl=0.6)
    try:
        pub.send(stored([1, 2, 3], None, PROMPT[:12]))
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 3})
        pub.answering = False                  # the publisher stops answering probes
        assert wait_until(lambda: not sub.live, timeout=5)
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {}, timeout=5)
        assert index_call(redis_server.url, "purge_dead_pods") == [POD]
        assert index_call(redis_server.url, "dump", MODEL) == {}

        # back: the subscriber cannot prove it missed nothing, so it rebuilds from the buffer
        pub.answering = True
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 3}, timeout=5)

        sub.set_healthy(False)                 # the router's health check failed
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {}, timeout=5)
        sub.set_healthy(True)
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 3}, timeout=5)
    finally:
        sub.stop()


def test_without_a_replay_endpoint_health_alone_keeps_the_pod_live(pub, redis_server):
    sub = subscriber(pub, redis_server.url, replay=False, ttl=0.6)
    try:
        # no replay: the slow-joining SUB may miss the first messages, so send until one lands
        assert wait_until(lambda: (pub.send(stored([1], None, PROMPT[:4])),
                                   lookup(redis_server.url, PROMPT) == {POD: 1})[1], timeout=5)
        assert sub.live and pub.replay_requests == []
        pub.send(stored([2], 1, PROMPT[4:8]), deliver=False, buffer=False)
        pub.send(stored([3], 2, PROMPT[8:12]))           # parent 2 unknown: left out
        assert wait_until(lambda: sub.lost_batches == 1 and sub.skipped_blocks == 1)
        assert lookup(redis_server.url, PROMPT) == {POD: 1}
    finally:
        sub.stop()


def test_an_engine_restart_forgets_its_blocks(redis_server):
    """The engine process restarts faster than a health check notices: its batches are
    numbered from 0 again, which tells the subscriber its old blocks are gone."""
    import time
    pub = FakeVllmPublisher()
    sub = subscriber(pub, redis_server.url)
    try:
        # NOTE: a restart shows in the LIVE stream (replays may repeat old numbers): send until
        # the subscriber has read numbers up to 5 live
        assert wait_until(lambda: (pub.send(stored([1, 2], None, PROMPT[:8])),
                                   (sub._last_live or 0) >= 5)[1], timeout=5)
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 2})
        ports = pub.pub_port, pub.replay_port
        pub.close()
        pub = None
        for _ in range(50):          # NOTE: ZMQ closes sockets asynchronously: retry the bind
            try:
                pub = FakeVllmPublisher(pub_port=ports[0], replay_port=ports[1])
                break
            except Exception:  # noqa: BLE001
                time.sleep(0.1)
        assert pub is not None
        time.sleep(0.5)              # the SUB socket reconnects (every 0.1 s)
        for _ in range(6):           # numbered 0..5 again, all <= the numbers seen before
            pub.send(stored([5], None, [9, 9, 9, 9]))
            if wait_until(lambda: sub.restarts == 1, timeout=0.2):
                break
        assert sub.restarts == 1
        assert wait_until(lambda: index_call(redis_server.url, "dump", MODEL) == {
            POD: set(prompt_block_hashes([9, 9, 9, 9], BS, "kvmesh"))})
    finally:
        sub.stop()
        if pub is not None:
            pub.close()


def test_a_redis_outage_is_repaired_from_memory(pub, redis_server):
    sub = subscriber(pub, redis_server.url)
    try:
        pub.send(stored([1, 2], None, PROMPT[:8]))
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 2})
        redis_server.stop()
        pub.send(stored([3], 2, PROMPT[8:12]))
        assert wait_until(lambda: sub.redis_errors >= 1, timeout=5)
        redis_server.start()                           # empty
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 3}, timeout=5)
    finally:
        sub.stop()


def test_malformed_messages_are_counted_and_the_stream_goes_on(pub, redis_server):
    """Fault injection: frames, payloads and events that are not vLLM's format."""
    import msgspec
    sub = subscriber(pub, redis_server.url)
    try:
        assert wait_until(lambda: 0 in pub.replay_requests)
        topic = b"kv-events"

        def raw(seq: int, payload: bytes, *extra: bytes) -> None:
            with pub._lock:
                pub.seq = seq + 1
                pub.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload, *extra])
        raw(0, b"\xc1not msgpack")
        raw(1, msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]))
        raw(2, msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                               "parent_block_hash": None,
                                               "token_ids": ["a", "b", "c", "d"],
                                               "block_size": 4}], 0]))
        raw(3, b"x", b"a fourth frame")
        with pub._lock:
            pub.pub.send_multipart([topic, b"\x00\x01", b"x"])      # a 2-byte sequence number
        assert wait_until(lambda: sub.decode_errors == 5)
        pub.seq = 4
        pub.send(stored([1], None, PROMPT[:4]))
        assert wait_until(lambda: lookup(redis_server.url, PROMPT) == {POD: 1})
        assert sub.running and sub.lost_batches == 1        # seq 3 never arrived intact
    finally:
        sub.stop()


def test_the_chain_rehashes_tokens_and_tracks_tiers():
    """EngineBlockChain alone (no I/O): exact kvmesh hashes, tiers counted per engine hash."""
    from kvmesh.common.block_hash import root_hash
    from kvmesh.index.vllm_chain import EngineBlockChain
    from kvmesh.index.vllm_wire import WireRemoved, WireStored
    chain = EngineBlockChain(root_hash("kvmesh"), BS)
    want = prompt_block_hashes(PROMPT, BS, "kvmesh")
    assert chain.stored(WireStored([b"\x01", b"\x02"], None, PROMPT[:8], BS, "gpu", False, None)) \
        == [(want[0], "gpu"), (want[1], "gpu")]
    assert chain.stored(WireStored([b"\x02"], b"\x01", PROMPT[4:8], BS, "cpu", False, None)) \
        == [(want[1], "cpu")]
    assert chain.stored(WireStored([b"\x02"], b"\x01", PROMPT[4:8], BS, "gpu", False, None)) == []
    assert chain.removed(WireRemoved([b"\x02"], "gpu")) == [(want[1], "gpu")]
    assert chain.entries() == {(want[0], "gpu"), (want[1], "cpu")}
    # the same engine hash for other tokens (a collision): the first mapping stays
    assert chain.stored(WireStored([b"\x01"], None, [1, 2, 3, 4], BS, "gpu", False, None)) == []
    assert chain.skipped_blocks == 1
    assert chain.removed(WireRemoved([b"\x02", b"\x09"], "cpu")) == [(want[1], "cpu")]
    chain.clear()
    assert chain.entries() == set()


def test_the_chain_keys_an_adapters_blocks_by_its_name():
    """A LoRA adapter's blocks (vLLM puts its name first in every block's extra keys, the cache
    salt after it in block 0) get kvmesh's hashes of that adapter, as the router looks them up;
    an adapter known only by its id, or keys that do not start with its name, are left out."""
    from kvmesh.common.block_hash import root_hash
    from kvmesh.index.vllm_chain import EngineBlockChain
    from kvmesh.index.vllm_wire import WireStored
    chain = EngineBlockChain(root_hash("kvmesh"), BS)
    want = prompt_block_hashes(PROMPT, BS, "kvmesh", lora_name="ad")
    assert want != prompt_block_hashes(PROMPT, BS, "kvmesh")
    assert chain.stored(WireStored([1, 2], None, PROMPT[:8], BS, "gpu", True, [["ad"], ["ad"]],
                                   "ad")) == [(want[0], "gpu"), (want[1], "gpu")]
    assert chain.stored(WireStored([3], 2, PROMPT[8:12], BS, "gpu", True, [["ad"]], "ad")) \
        == [(want[2], "gpu")]
    # without per-block keys (an older vLLM): the name alone
    assert chain.stored(WireStored([4], None, PROMPT[:4], BS, "cpu", True, None, "ad")) \
        == [(want[0], "cpu")]
    salted = prompt_block_hashes(PROMPT, BS, "kvmesh", TENANT, lora_name="ad")
    assert chain.stored(WireStored([5, 6], None, PROMPT[:8], BS, "gpu", True,
                                   [["ad", TENANT], ["ad"]], "ad")) == \
        [(salted[0], "gpu"), (salted[1], "gpu")]
    assert chain.skipped_blocks == 0
    assert chain.stored(WireStored([7], None, PROMPT[:4], BS, "gpu", True, None, None)) == []
    assert chain.stored(WireStored([8], None, PROMPT[:4], BS, "gpu", True, [["other"]], "ad")) == []
    assert chain.stored(WireStored([9], None, PROMPT[:4], BS, "gpu", True, [["ad", ["mm", 0]]],
                                   "ad")) == []
    assert chain.skipped_blocks == 3
