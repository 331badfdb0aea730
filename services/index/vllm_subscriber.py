"""VllmEventSubscriber: one vLLM engine's ZMQ KV events -> the shared Redis prefix index.

    vLLM PUB ──(topic, seq, payload)──▶ SUB ─┐
    vLLM ROUTER ◀── "from seq N" ── DEALER ◀─┤  thread: decode (vllm_wire) → rehash → Redis
                                             └─ heartbeat pod:{id} while the engine is live

The index must be keyed by kvmesh's own chained block hash (kvmesh.common.block_hash), since
that is what the router computes for a prompt; vLLM's hashes depend on its version, hash
function and seed. The events carry their blocks' token ids: vllm_chain.py re-hashes them.

The chain in memory is the pod's whole state, so after a Redis error the subscriber rewrites the
pod's entries from it. Sequence numbers: a gap asks the replay socket for the missing range;
what the replay cannot supply is counted as lost. A number on the PUB socket at or below one
already read there means the engine restarted: its old blocks are forgotten. (A restart slower
than a health check is caught anyway: the pod is unhealthy meanwhile, a lapse, see below.)

Liveness: the pod counts as live while `set_healthy(True)` (the router's health checks) and,
when a replay endpoint is known, while the publisher answers a probe (a replay request from the
next number) within `heartbeat_ttl_s`. While not live no heartbeat is written, so the pod's
entries stop counting when its heartbeat key expires and PURGE_DEAD_PODS deletes them; once live
again the subscriber cannot prove it missed nothing, so it clears the pod's entries and rebuilds
them from the replay buffer.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis
import zmq
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.common.block_hash import hash_hex, root_hash
from kvmesh.index.connect import redis_client_kwargs
from kvmesh.index.layout import CLEAR_POD, KeySpace, block_member, pod_block_member
from kvmesh.index.vllm_chain import EngineBlockChain
from kvmesh.index.vllm_wire import (WireCleared, WireFormatError, WireRemoved, WireStored,
                                    decode_batch, seq_bytes, seq_from_bytes)

logger = logging.getLogger("kvmesh.index.vllm_subscriber")

_REDIS_ERRORS = (redis.RedisError, OSError)


@dataclass(frozen=True, slots=True)
class VllmSource:
    """Where one vLLM engine is and publishes."""
    pod_id: str                     # its id in the index (host:port of its HTTP endpoint)
    url: str                        # its base URL, as the router's backends name it
    endpoint: str                   # its PUB socket, tcp://HOST:PORT
    replay_endpoint: str | None     # its ROUTER replay socket; None: no replay, no probe
    topic: str = ""                 # the topic it publishes under


@dataclass(frozen=True, slots=True)
class IndexTarget:
    """Where and how blocks are written: the shared index's layout and hashing parameters."""
    redis_url: str
    model: str                      # served model name: blocks are keyed by it (layout.py)
    block_size: int                 # the router's --block-size: events of another size are skipped
    hash_seed: str = "kvmesh"
    namespace: str | None = None
    service: str | None = None
    password: str | None = None


class VllmEventSubscriber:
    """Follow one vLLM engine's KV events into the Redis index on a thread (see module doc)."""

    def __init__(self, source: VllmSource, target: IndexTarget,
                 heartbeat_interval_s: float = 1.0, heartbeat_ttl_s: float = 5.0,
                 probe_interval_s: float = 1.0, context: zmq.Context | None = None,
                 start: bool = True) -> None:
        if heartbeat_ttl_s <= heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_interval_s")
        self.source = source
        self.target = target
        self.keys = KeySpace.from_env(target.namespace, target.service)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.probe_interval_s = probe_interval_s
        self._ctx = context or zmq.Context.instance()
        self._client = redis.Redis.from_url(
            target.redis_url, password=target.password, socket_timeout=1.0,
            socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0), decode_responses=True,
            **redis_client_kwargs(target.redis_url))
        self._clear_pod = self._client.register_script(CLEAR_POD)
        # ---- set by the router (any thread) ----
        self._healthy = True
        self._load = (0, 0, 0.0)             # running, waiting, kv usage (from /metrics)
        # ---- thread-private state: the engine's blocks as the events describe them ----
        self._chain = EngineBlockChain(root_hash(target.hash_seed), target.block_size)
        self._next_seq: int | None = None    # the next number expected (None: nothing yet)
        self._last_live: int | None = None   # the highest number read from the SUB socket
        self._last_answer = time.monotonic()  # the publisher last proved it is there
        self._dirty = True                   # Redis may differ from memory: rewrite the pod
        self._was_live = True
        # ---- counters (metrics, tests) ----
        self.batches_applied = 0
        self.replays = 0                     # replay requests sent for gaps
        self.lost_batches = 0                # numbers neither the stream nor a replay supplied
        self.restarts = 0                    # engine restarts seen (sequence numbers reset)
        self.decode_errors = 0
        self.redis_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"vllm-events-{source.pod_id}")
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    # ---- router-facing ---------------------------------------------------------------------
    def set_healthy(self, healthy: bool) -> None:
        """The router's health check of the engine's HTTP endpoint."""
        self._healthy = bool(healthy)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The engine's load (from its /metrics); the heartbeat carries it to every router."""
        self._load = (int(running), int(waiting), float(kv_usage))

    @property
    def running(self) -> bool:
        """The thread is following the stream (False once stopped or failed)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def live(self) -> bool:
        """Healthy, and (with a replay endpoint) the publisher answered within the TTL."""
        if not self._healthy:
            return False
        if self.source.replay_endpoint is None:
            return True
        return time.monotonic() - self._last_answer < self.heartbeat_ttl_s

    def blocks(self) -> set[tuple[bytes, str]]:
        """(kvmesh hash, tier) of every block the subscriber believes the engine holds."""
        return self._chain.entries()

    @property
    def skipped_blocks(self) -> int:
        """Blocks left out of the index (LoRA, extra keys, block size, unknown parent)."""
        return self._chain.skipped_blocks

    def stop(self, clear: bool = True, timeout: float = 2.0) -> None:
        """Stop the thread; with `clear`, delete the pod's entries and heartbeat (it left)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if clear:
            try:
                pipe = self._client.pipeline(transaction=True)
                self._clear(pipe)
                pipe.delete(self.keys.pod(self.source.pod_id))
                pipe.zrem(self.keys.pods, self.source.pod_id)
                pipe.execute()
            except _REDIS_ERRORS as e:
                logger.warning("could not clear %s from the prefix index (%s); its entries "
                               "expire with its heartbeat", self.source.pod_id, e)
        self._client.close()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        self._dealer: zmq.Socket | None = None
        self._pending = 0                     # replay requests not yet answered to the end
        self._asked_at = 0.0                  # when the oldest of them was sent
        next_heartbeat = next_probe = 0.0
        try:
            # NOTE: everything buffered first (blocks stored before we connected); live
            # messages wait in the SUB socket meanwhile and are de-duplicated by number
            if self._request_replay(0):
                self._wait_replay()
                next_probe = time.monotonic() + self.probe_interval_s
            while not self._stop.is_set():
                if sub.poll(50):
                    while sub.poll(0):
                        frames = sub.recv_multipart()
                        if len(frames) != 3:
                            self.decode_errors += 1      # not a (topic, seq, payload) message
                            continue
                        self._on_message(*frames, live=True)
                self._drain_replies()
                now = time.monotonic()
                if self.source.replay_endpoint is not None and now >= next_probe:
                    self._probe(now)
                    next_probe = now + self.probe_interval_s
                if now >= next_heartbeat:
                    self._tick()
                    next_heartbeat = now + self.heartbeat_interval_s
        except Exception:  # noqa: BLE001 - logged; the router restarts subscribers it lost
            logger.exception("KV event subscriber for %s failed", self.source.pod_id)
        finally:
            sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)

    def _tick(self) -> None:
        """Heartbeat while live; after a lapse, forget and rebuild; rewrite Redis when dirty."""
        live = self.live
        if live and not self._was_live:
            logger.info("%s is live again: rebuilding its index entries from the replay "
                        "buffer", self.source.pod_id)
            self._forget()
            if self._request_replay(0):
                self._wait_replay()
        self._was_live = live
        try:
            if self._dirty:
                self._rewrite()
            if live:
                self._heartbeat()
        except _REDIS_ERRORS as e:
            self.redis_errors += 1
            self._dirty = True
            logger.warning("prefix index write for %s failed (%s); rewriting when Redis "
                           "answers", self.source.pod_id, e)

    # ---- sequence numbers and replay ---------------------------------------------------------
    def _on_message(self, topic: bytes, seq_frame: bytes, payload: bytes, live: bool) -> None:
        try:
            seq = seq_from_bytes(seq_frame)
        except ValueError:
            self.decode_errors += 1
            return
        if live:
            self._last_answer = time.monotonic()
            if self._last_live is not None and seq <= self._last_live:
                self.restarts += 1
                logger.warning("%s restarted (KV event %d after %d): forgetting its blocks",
                               self.source.pod_id, seq, self._last_live)
                self._forget()
            self._last_live = seq
        if self._next_seq is not None and seq < self._next_seq:
            return                                    # already applied (a replay overlap)
        if self._next_seq is not None and seq > self._next_seq:
            if live and self._request_replay(self._next_seq):
                self.replays += 1
                self._wait_replay()
                if seq < self._next_seq:
                    return                            # the replay brought this one too
            if seq > self._next_seq:                  # still missing: the replay had none
                self.lost_batches += seq - self._next_seq
                logger.warning("%s: KV events %d..%d are lost", self.source.pod_id,
                               self._next_seq, seq - 1)
        self._apply_payload(payload)
        self._next_seq = seq + 1

    def _replay_socket(self) -> zmq.Socket | None:
        if self.source.replay_endpoint is None:
            return None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.source.replay_endpoint)
        return self._dealer

    def _request_replay(self, start: int) -> bool:
        sock = self._replay_socket()
        if sock is None:
            return False
        try:
            sock.send_multipart([b"", seq_bytes(start)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not self._pending:
            self._asked_at = time.monotonic()
        self._pending += 1
        return True

    def _wait_replay(self, timeout_s: float = 2.0) -> None:
        """Read replay answers until every request got its end marker (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and self._dealer is not None and time.monotonic() < deadline:
            if self._dealer.poll(50):
                self._drain_replies()

    def _drain_replies(self) -> None:
        sock = self._dealer
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 4:
                self.decode_errors += 1
                continue
            _, topic, seq_frame, payload = frames
            self._last_answer = time.monotonic()
            if topic == b"" and payload == b"" and seq_frame == seq_bytes(-1):
                self._pending = max(0, self._pending - 1)     # an end marker
                self._asked_at = time.monotonic()
                continue
            self._on_message(topic, seq_frame, payload, live=False)

    def _probe(self, now: float) -> None:
        """Ask for anything after what we have: the end marker proves the publisher is there.
        An unanswered probe is dropped with its socket (a dead peer would queue them)."""
        if self._pending:
            if now - self._asked_at < self.heartbeat_ttl_s:
                return
            self._dealer.close(linger=0)
            self._dealer = None
            self._pending = 0
        self._request_replay(self._next_seq or 0)

    # ---- events -> the chain ------------------------------------------------------------------
    def _apply_payload(self, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except WireFormatError as e:
            self.decode_errors += 1
            logger.warning("%s: undecodable KV event batch (%s)", self.source.pod_id, e)
            return
        pipe = self._client.pipeline(transaction=True)
        for event in events:
            if isinstance(event, WireStored):
                for h, tier in self._chain.stored(event):
                    self._add(pipe, h, tier)
            elif isinstance(event, WireRemoved):
                for h, tier in self._chain.removed(event):
                    self._remove(pipe, h, tier)
            elif isinstance(event, WireCleared):
                self._forget()
        self.batches_applied += 1
        if self._dirty:
            return                          # the next tick rewrites the pod from memory
        try:
            pipe.execute()
        except _REDIS_ERRORS as e:
            self.redis_errors += 1
            self._dirty = True
            logger.warning("prefix index write for %s failed (%s)", self.source.pod_id, e)

    def _forget(self) -> None:
        """The engine dropped every block (AllBlocksCleared, a restart, a lapse)."""
        self._chain.clear()
        self._next_seq = None
        self._dirty = True

    # ---- Redis (key names from layout.py) ------------------------------------------------------
    def _add(self, pipe, h: bytes, tier: str) -> None:
        hx, pod = hash_hex(h), self.source.pod_id
        pipe.sadd(self.keys.block(self.target.model, hx), block_member(pod, tier))
        pipe.sadd(self.keys.pod_blocks(pod), pod_block_member(tier, self.target.model, hx))

    def _remove(self, pipe, h: bytes, tier: str) -> None:
        hx, pod = hash_hex(h), self.source.pod_id
        pipe.srem(self.keys.block(self.target.model, hx), block_member(pod, tier))
        pipe.srem(self.keys.pod_blocks(pod), pod_block_member(tier, self.target.model, hx))

    def _clear(self, pipe) -> None:
        self._clear_pod(keys=[self.keys.pod_blocks(self.source.pod_id)],
                        args=[self.keys.prefix, self.source.pod_id], client=pipe)

    def _rewrite(self) -> None:
        pipe = self._client.pipeline(transaction=True)
        self._clear(pipe)
        for h, tier in self.blocks():
            self._add(pipe, h, tier)
        pipe.execute()
        self._dirty = False

    def _heartbeat(self) -> None:
        running, waiting, kv_usage = self._load
        key = self.keys.pod(self.source.pod_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.exists(key)
        pipe.hset(key, mapping={"url": self.source.url, "model": self.target.model,
                                "running": running, "waiting": waiting, "swapped": 0,
                                "kv_usage": kv_usage, "ts": time.time(),
                                "seq": -1 if self._next_seq is None else self._next_seq - 1})
        pipe.pexpire(key, int(self.heartbeat_ttl_s * 1000))
        pipe.zadd(self.keys.pods, {self.source.pod_id: time.time()})
        if not pipe.execute()[0]:
            # NOTE: the key lapsed (or Redis restarted): a purge may have removed our entries
            self._rewrite()

