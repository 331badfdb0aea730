"""`kvmesh serve --kv-events-config`: publish the engine's KV events over ZMQ in vLLM's format.

    engine step ── on_step(report) ──▶ bounded queue ──▶ sender thread ── PUB ──▶ subscribers
                                       (seq assigned        │  (topic, seq, payload)
                                        here; full: drop)   └─ replay buffer ◀── ROUTER ◀── "send
                                                               (buffer_steps)     from seq N"

Consumers are vLLM-aware routers (kvmesh's own router with --backend-kind vllm, llm-d's
precise-prefix-cache scorer). The wire format is in vllm_wire.py. The engine thread only puts a
batch on a bounded queue (never blocks); the sender thread owns both sockets, encodes, sends and
keeps the last `buffer_steps` messages for replay.

NOTE: sequence numbers are assigned when the engine hands a batch over, not when it is sent, so
a batch dropped on a full queue leaves a gap that subscribers see (and cannot fill by replay):
they learn that they missed events instead of silently diverging.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from kvmesh.engine.observers import EngineObserver, LoadSnapshot, StepReport
from kvmesh.common.kv_events import KVEventBatch
from kvmesh.index.vllm_wire import END_SEQ, encode_batch, seq_bytes, seq_from_bytes

logger = logging.getLogger("kvmesh.index.zmq_events")

_ENDPOINT = re.compile(r"^(?:tcp://(?P<host>\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)"
                       r"|ipc://.+|inproc://.+)$")
_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
         "hwm", "max_queue_size", "topic")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (same keys, same defaults), validated."""
    endpoint: str = "tcp://*:5557"          # PUB socket: bind (tcp://*:P, ipc://, inproc://)
    #                                         or connect (tcp://host:P) to a forwarder
    replay_endpoint: str | None = None      # ROUTER socket answering replay requests; None: off
    buffer_steps: int = 10_000              # batches kept for replay
    hwm: int = 100_000                      # ZMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000           # batches waiting for the sender thread; more: dropped
    topic: str = ""                         # first frame of every message

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> KVEventsConfig | None:
        """The flag's JSON (or a dict from a --config file) -> a config, or None when events are
        off. ValueError naming the problem for anything vLLM would not accept as well."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--kv-events-config must be a JSON object, e.g. "
                             '{"enable_kv_cache_events": true, "publisher": "zmq", '
                             '"endpoint": "tcp://*:5557"}')
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(_KEYS)}")
        enabled = value.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        publisher = value.get("publisher", "zmq" if enabled else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be \"zmq\" (kvmesh publishes "
                             f"over ZMQ only), got {publisher!r}")
        if not enabled or publisher == "null":
            return None
        fields = {k: value[k] for k in _KEYS[2:] if k in value}
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"--kv-events-config: {e}") from None

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if not _is_bind(self.replay_endpoint):
                raise ValueError("--kv-events-config: replay_endpoint must be one to bind "
                                 f"(tcp://*:PORT, ipc:// or inproc://), got {self.replay_endpoint!r}")
            if self.replay_endpoint == self.endpoint:
                raise ValueError("--kv-events-config: endpoint and replay_endpoint must differ")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= {low}, got {v!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"--kv-events-config: topic must be a string, got {self.topic!r}")


def _check_endpoint(name: str, endpoint: Any) -> None:
    m = _ENDPOINT.match(endpoint) if isinstance(endpoint, str) else None
    if m is None or (m.group("port") is not None and not 0 < int(m.group("port")) < 65536):
        raise ValueError(f"--kv-events-config: {name} must be tcp://HOST:PORT (HOST * to bind), "
                         f"ipc://PATH or inproc://NAME, got {endpoint!r}")


def _is_bind(endpoint: str) -> bool:
    """As vLLM decides: wildcard hosts and ipc/inproc bind; tcp://host:port connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher(EngineObserver):
    """The engine's KV events on a ZMQ PUB socket (see the module doc). Sockets are bound in the
    constructor, so a port in use fails `kvmesh serve` at start-up (zmq.ZMQError)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, float, list] | None] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0                 # engine thread only
        # ---- counters for metrics ----
        self.batches_published = 0         # messages sent on the PUB socket
        self.batches_dropped = 0           # batches dropped on a full queue (seen as gaps)
        self.replays_served = 0            # replay requests answered
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _is_bind(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    # ---- engine-facing (never blocks) ----------------------------------------------------------
    def publish(self, batch: KVEventBatch | None) -> None:
        """Number the batch and queue it; on a full queue drop it (its number stays a gap)."""
        if batch is None or not batch.events or self._closed:
            return
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch.ts, list(batch.events)))
        except queue.Full:
            self.batches_dropped += 1
            if self.batches_dropped == 1 or self.batches_dropped % 1000 == 0:
                logger.warning("KV event queue full (%d batches): dropped batch %d (%d dropped "
                               "so far); subscribers see a gap", self.config.max_queue_size,
                               seq, self.batches_dropped)

    def on_step(self, report: StepReport) -> None:
        self.publish(report.kv_events)

    def on_cache_reset(self, kv_events: KVEventBatch | None, load: LoadSnapshot) -> None:
        self.publish(kv_events)

    def on_shutdown(self) -> None:
        self.close()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put_nowait(None)      # after what is queued
        except queue.Full:
            self._stop.set()                  # a full queue: give up on it
        self._thread.join(timeout)
        self._stop.set()
        self._thread.join(0.5)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self._send(*item)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad batch
                logger.exception("could not publish KV event batch %d", item[0])
                time.sleep(0.05)

    def _send(self, seq: int, ts: float, events: list) -> None:
        payload = encode_batch(ts, events, self.data_parallel_rank)
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self.batches_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        try:
            first = seq_from_bytes(start)
        except ValueError as e:
            logger.warning("ignoring a KV event replay request: %s", e)
            first = None
        if first is not None:
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq),
                                                 payload))
        self.replays_served += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
