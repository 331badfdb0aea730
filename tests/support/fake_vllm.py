"""A stand-in for a vLLM engine's KV-event publisher, written from vLLM's published format.

PUB socket: (topic, 8-byte big-endian seq, msgpack KVEventBatch); ROUTER socket: a replay request
(8-byte start seq) is answered with every buffered batch since, then the end marker. The engine
hashes are arbitrary ints (as vLLM's are, to kvmesh): a subscriber must not use them as keys.
The structs are the test's own, not the project's encoder.
"""
from __future__ import annotations

import threading
import time

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


class VStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = 0


class VRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


class VCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = 0


class FakeVllmPublisher:
    """PUB + ROUTER on loopback ports; `send` numbers batches 0, 1, ... like vLLM."""

    def __init__(self, topic: str = "kv-events", pub_port: int | None = None,
                 replay_port: int | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if pub_port:
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
            self.pub_port = pub_port
        else:
            self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = replay_port
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.answering = True          # False: the replay socket goes silent
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if replay_port:
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        else:
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, *events, deliver: bool = True, buffer: bool = True) -> int:
        """Publish one batch; `deliver=False` keeps it off the PUB socket (a lost message),
        `buffer=False` off the replay buffer too. Returns its number."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            payload = msgspec.msgpack.encode(VBatch(time.time(), list(events)))
            if buffer:
                self.buffer.append((seq, payload))
            if deliver:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, empty, start = self.router.recv_multipart()
            if not self.answering:
                continue
            first = int.from_bytes(start, "big")
            with self._lock:
                self.replay_requests.append(first)
                for seq, payload in self.buffer:
                    if seq >= first:
                        self.router.send_multipart([client, b"", self.topic,
                                                    seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
