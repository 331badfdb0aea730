"""KVEventPublisher: the engine's KV events and load -> the Redis prefix index, off the step path.

    engine step ── publish(batch) ──▶ bounded deque ──▶ publisher thread ── MULTI pipeline ──▶ Redis
                └─ update_load(...) ─▶ latest snapshot ─▶ heartbeat every heartbeat_interval_s

The engine only appends to a deque (a lock held for an append), so a slow or dead Redis never
blocks a step. The thread owns its own client. Whenever the index may have diverged from the
engine (start, Redis outage, queue overflow, a gap in batch numbers) it resynchronises: it drops
what is queued, reads a full snapshot of the engine's cached hashes, and atomically replaces this
pod's entries with it; later batches are applied on top.

NOTE: why dropping queued batches before the snapshot is safe: they hold events that happened
before the snapshot was read. Batches queued after that may still hold a few such events (taken
from the pool before the snapshot, enqueued after); replaying a suffix of the event stream onto a
later state is harmless, since each event sets a block present or absent and the events after it
are replayed too.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.common.block_hash import hash_hex
from kvmesh.engine.observers import EngineObserver, LoadSnapshot, StepReport
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmesh.index.connect import redis_client_kwargs
from kvmesh.index.layout import (CLEAR_POD, PURGE_DEAD_PODS, KeySpace, block_member,
                                 pod_block_member)

logger = logging.getLogger("kvmesh.index.publisher")

SnapshotFn = Callable[[], Iterable[tuple[bytes, str]]]
_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
                 redis.ReadOnlyError, OSError)


def _load_tuple(load: LoadSnapshot) -> tuple[int, int, int, float]:
    return load.running, load.waiting, load.swapped, load.kv_usage


class KVEventPublisher(EngineObserver):
    """Publish one pod's KV events and load to the Redis prefix index (see the module doc).
    As an engine observer it takes each step's event batch and load; it never blocks a step."""

    def __init__(self, redis_url: str, pod_id: str, model: str, pod_url: str,
                 namespace: str | None = None, service: str | None = None,
                 flush_interval_s: float = 0.05, heartbeat_interval_s: float = 1.0,
                 heartbeat_ttl_s: float = 5.0, password: str | None = None,
                 snapshot_fn: SnapshotFn | None = None, max_queue: int = 10_000,
                 socket_timeout_s: float = 1.0, start: bool = True) -> None:
        if not pod_id or not model:
            raise ValueError("pod_id and model must be non-empty (set --pod-id / $POD_NAME)")
        if heartbeat_ttl_s <= heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({heartbeat_ttl_s}) must exceed "
                             f"heartbeat_interval_s ({heartbeat_interval_s})")
        self.pod_id = pod_id
        self.model = model
        self.pod_url = pod_url
        self.keys = KeySpace.from_env(namespace, service)
        self.flush_interval_s = flush_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.snapshot_fn = snapshot_fn
        self.max_queue = max_queue
        # NOTE: no client-side retries: the thread has its own backoff and resync logic.
        self._client = redis.Redis.from_url(
            redis_url, password=password, socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0),
            decode_responses=True, **redis_client_kwargs(redis_url))
        self._clear_pod = self._client.register_script(CLEAR_POD)
        self._purge = self._client.register_script(PURGE_DEAD_PODS)

        # ---- shared with the engine thread (guarded by _lock) ----
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._enqueued = 0                # batches accepted by publish (ticket numbers)
        self._done = 0                    # tickets applied or covered by a resync
        self._resync_needed = True        # start == a resync: clear old entries, snapshot
        self._load = (0, 0, 0, 0.0)       # running, waiting, swapped, kv_usage
        # ---- counters for metrics ----
        self.events_published = 0         # events applied to Redis
        self.batches_dropped = 0          # batches dropped on a full queue
        self.resyncs = 0                  # full snapshots written (the first one included)
        self.redis_errors = 0             # failed Redis round trips
        self.heartbeat_lapses = 0         # heartbeats found expired (each forces a resync)
        self.connected = False            # the last round trip succeeded
        # ---- thread-private ----
        self._last_seq: int | None = None
        self._next_heartbeat = 0.0
        self._next_purge = 0.0
        self._logged_outage = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-publisher-{pod_id}",
                                        daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the thread (the constructor does unless start=False)."""
        self._thread.start()

    # ---- engine-facing (never blocks on I/O) ------------------------------------------------
    def publish(self, batch: KVEventBatch | None) -> None:
        """Queue a batch; on a full queue drop it and schedule a resync."""
        if batch is None or not batch.events:
            return
        with self._lock:
            self._enqueued += 1
            if len(self._queue) >= self.max_queue:
                self.batches_dropped += 1
                self._resync_needed = True
                return
            self._queue.append((self._enqueued, batch))

    def update_load(self, running: int, waiting: int, swapped: int, kv_usage: float) -> None:
        """Latest load snapshot; the next heartbeat carries it."""
        self._load = (int(running), int(waiting), int(swapped), float(kv_usage))

    # ---- engine observer ---------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        self.publish(report.kv_events)
        self.update_load(*_load_tuple(report.load))

    def on_cache_reset(self, kv_events: KVEventBatch | None, load: LoadSnapshot) -> None:
        self.publish(kv_events)
        self.update_load(*_load_tuple(load))

    def on_shutdown(self) -> None:
        self.close()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything published so far is in Redis (True) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            self._wake.set()
            while self._done < target or self._resync_needed or not self.connected:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.05))
                self._wake.set()
        return True

    def close(self, clear: bool = True, timeout: float = 2.0) -> None:
        """Stop the thread; with `clear`, remove this pod's entries and heartbeat (clean
        shutdown). `clear=False` leaves them to expire, as a crashed pod would."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if clear:
            try:
                self._clear_entries(drop_heartbeat=True)
            except _REDIS_ERRORS as e:
                logger.warning("could not clear pod %s from the Redis prefix index on shutdown "
                               "(%s); its entries expire with its heartbeat", self.pod_id, e)
        self._client.close()

    @property
    def queue_len(self) -> int:
        return len(self._queue)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                self._tick()
                backoff = 0.05
                if self._logged_outage:
                    logger.info("Redis prefix index reachable again; pod %s resynchronised",
                                self.pod_id)
                self._set_connected(True)
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            except _REDIS_ERRORS as e:
                self.redis_errors += 1
                self._set_connected(False)
                with self._lock:
                    self._resync_needed = True
                if not self._logged_outage:
                    self._logged_outage = True
                    logger.warning("Redis prefix index unreachable (%s: %s); pod %s keeps "
                                   "serving and resynchronises when Redis returns",
                                   type(e).__name__, e, self.pod_id)
                self._discard_queue()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # noqa: BLE001 - the thread must survive bugs in one batch
                logger.exception("KV event publisher error; resynchronising")
                with self._lock:
                    self._resync_needed = True
                self._stop.wait(0.5)

    def _set_connected(self, value: bool) -> None:
        with self._cond:
            self.connected = value
            if value:
                self._logged_outage = False
            self._cond.notify_all()

    def _discard_queue(self) -> None:
        """While a resync is pending, queued batches are covered by the coming snapshot."""
        if self.snapshot_fn is None:
            return    # nothing else will restore them; the bounded queue caps the memory
        with self._lock:
            self._queue.clear()

    def _tick(self) -> None:
        # NOTE: resync before the first heartbeat, so a restarted pod's stale entries are gone
        # before it counts as live again.
        if self._resync_needed:
            self._resync()
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = now + self.heartbeat_interval_s
        self._apply_queued()
        if now >= self._next_purge:
            self._purge(keys=[self.keys.pods], args=[self.keys.prefix])
            self._next_purge = now + 5 * self.heartbeat_interval_s

    def _heartbeat(self, after_resync: bool = False) -> None:
        """Refresh this pod's heartbeat. NOTE: a heartbeat key that is gone means it lapsed (a
        stall longer than its TTL, a Redis restart) and another pod's purge may have removed
        this pod's entries: resync, so the index again equals the engine's cache."""
        running, waiting, swapped, kv_usage = self._load
        pipe = self._client.pipeline(transaction=True)
        key = self.keys.pod(self.pod_id)
        pipe.exists(key)
        pipe.hset(key, mapping={"url": self.pod_url, "model": self.model, "running": running,
                                "waiting": waiting, "swapped": swapped, "kv_usage": kv_usage,
                                "seq": -1 if self._last_seq is None else self._last_seq,
                                "ts": time.time()})
        pipe.pexpire(key, int(self.heartbeat_ttl_s * 1000))
        pipe.zadd(self.keys.pods, {self.pod_id: time.time()})
        present = pipe.execute()[0]
        if not present and not after_resync:
            self.heartbeat_lapses += 1
            logger.warning("pod %s: heartbeat had lapsed (its index entries may have been "
                           "purged); resynchronising", self.pod_id)
            with self._lock:
                self._resync_needed = True

    def _resync(self) -> None:
        with self._lock:
            self._resync_needed = False
            if self.snapshot_fn is not None:
                covered = self._enqueued
                self._queue.clear()
            else:
                # NOTE: without a snapshot the queued events are all we know: keep them.
                covered = self._enqueued - len(self._queue)
        try:
            snapshot = list(self.snapshot_fn()) if self.snapshot_fn is not None else []
            pipe = self._client.pipeline(transaction=True)
            self._clear_pod(keys=[self.keys.pod_blocks(self.pod_id)],
                            args=[self.keys.prefix, self.pod_id], client=pipe)
            self._add(pipe, snapshot)
            pipe.execute()
        except BaseException:
            with self._lock:
                self._resync_needed = True
            raise
        self._last_seq = None
        self.resyncs += 1
        self._heartbeat(after_resync=True)   # a fresh heartbeat so the new entries count at once
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval_s
        logger.info("pod %s: prefix index resynchronised with %d cached blocks", self.pod_id,
                    len(snapshot))
        with self._cond:
            self._done = max(self._done, covered)
            self._cond.notify_all()

    def _apply_queued(self) -> None:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
        if not items:
            return
        # NOTE: a gap in sequence numbers means the engine lost events: resync instead.
        for _, batch in items:
            if self._last_seq is not None and batch.seq != self._last_seq + 1:
                logger.warning("pod %s: KV event batch %d follows %d (gap); resynchronising",
                               self.pod_id, batch.seq, self._last_seq)
                with self._lock:
                    self._resync_needed = True
                return
            self._last_seq = batch.seq
        pipe = self._client.pipeline(transaction=True)
        n = 0
        for _, batch in items:
            for event in batch.events:
                self._apply_event(pipe, event)
                n += 1
        try:
            pipe.execute()
        except BaseException:
            with self._lock:
                self._resync_needed = True
            raise
        self.events_published += n
        with self._cond:
            self._done = max(self._done, items[-1][0])
            self._cond.notify_all()

    def _apply_event(self, pipe, event) -> None:
        if isinstance(event, BlockStored):
            self._add(pipe, [(h, event.medium) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            self._remove(pipe, [(h, event.medium) for h in event.block_hashes])
        elif isinstance(event, AllBlocksCleared):
            self._clear_pod(keys=[self.keys.pod_blocks(self.pod_id)],
                            args=[self.keys.prefix, self.pod_id], client=pipe)
        else:
            raise TypeError(f"unknown KV event {type(event).__name__}")

    def _add(self, pipe, entries: Iterable[tuple[bytes, str]]) -> None:
        self._update(pipe.sadd, entries)

    def _remove(self, pipe, entries: Iterable[tuple[bytes, str]]) -> None:
        self._update(pipe.srem, entries)

    def _update(self, op, entries: Iterable[tuple[bytes, str]]) -> None:
        """op (a pipeline's sadd or srem) on each block's set of pods and on this pod's set of
        blocks, the two sides of the index kept in step."""
        members = []
        for h, tier in entries:
            hx = hash_hex(h)
            op(self.keys.block(self.model, hx), block_member(self.pod_id, tier))
            members.append(pod_block_member(tier, self.model, hx))
        if members:
            op(self.keys.pod_blocks(self.pod_id), *members)

    def _clear_entries(self, drop_heartbeat: bool) -> None:
        pipe = self._client.pipeline(transaction=True)
        self._clear_pod(keys=[self.keys.pod_blocks(self.pod_id)],
                        args=[self.keys.prefix, self.pod_id], client=pipe)
        if drop_heartbeat:
            pipe.delete(self.keys.pod(self.pod_id))
            pipe.zrem(self.keys.pods, self.pod_id)
        pipe.execute()


class EngineState(Protocol):
    """What the publisher needs of an engine outside its observer calls (LLMEngine has both)."""

    def take_kv_event_batch(self) -> KVEventBatch | None: ...

    def load(self) -> LoadSnapshot: ...


def publish_engine_state(publisher: KVEventPublisher, engine: EngineState) -> None:
    """Drain the engine's pending KV events into the publisher and refresh its load (the
    state before the publisher observed any step)."""
    publisher.publish(engine.take_kv_event_batch())
    publisher.update_load(*_load_tuple(engine.load()))
