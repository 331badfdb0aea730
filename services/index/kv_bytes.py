"""Cross-pod KV bytes (`--kv-share redis`): full prefix blocks stored in Redis, loaded by any pod.
The engine's KVConnector (engine/kv_connector.py); key names come from layout.py.

An engine that completes a prompt stores the KV bytes of its full blocks under a key naming the
model, dtype, cache layout and the chained block hash; an engine that misses locally but finds
the following blocks in Redis loads them instead of recomputing. The chained hash pins the whole
prefix, so loaded bytes are exactly what this engine would compute: greedy outputs stay identical.

NOTE: Redis trouble never reaches the engine thread: reads are prefetched by a background
thread when a request starts waiting (the scheduler's lookup only takes what already arrived),
writes go out on another, and a circuit breaker skips Redis for a cool-down after repeated
failures, so a Redis that accepts and never answers costs no step any time.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.common.block_hash import hash_hex
from kvmesh.engine.kv_connector import (KVConnector, KVConnectorContext, KVConnectorFactory,
                                        KVConnectorStats)
from kvmesh.index.breaker import CircuitBreaker
from kvmesh.index.connect import redis_client_kwargs
from kvmesh.index.layout import KeySpace

logger = logging.getLogger("kvmesh.index.kv_bytes")


def redis_kv_connector(redis_url: str, password: str | None = None) -> KVConnectorFactory:
    """The factory an engine takes (`LLMEngine(..., kv_connector=...)`) for a `RedisKVStore` at
    `redis_url`, keyed by the engine's weights, dtype and block layout."""
    def build(ctx: KVConnectorContext) -> RedisKVStore:
        return RedisKVStore(redis_url, ctx.model, ctx.dtype, ctx.block_layout, password=password)
    return build


class RedisKVStore(KVConnector):
    def __init__(self, redis_url: str, model: str, dtype: str, layout: tuple[int, ...],
                 namespace: str | None = None, service: str | None = None,
                 password: str | None = None, ttl_s: int = 3600, max_pending: int = 512,
                 socket_timeout_s: float = 1.0, max_prefetched: int = 256,
                 breaker: CircuitBreaker | None = None) -> None:
        self.block_bytes = 1
        for d in layout:
            self.block_bytes *= d
        self.prefix = KeySpace.from_env(namespace, service).kv_bytes_prefix(model, dtype, layout)
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(redis_url, password=password,
                                            socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s,
                                            retry=Retry(NoBackoff(), 0),
                                            **redis_client_kwargs(redis_url))
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stored: OrderedDict[bytes, None] = OrderedDict()   # hashes known to be in Redis
        self._stored_cap = 65536
        self._outage_logged = False
        self.breaker = breaker or CircuitBreaker("KV sharing")
        # NOTE: prefetch results per waiting request, bounded: the oldest are forgotten first
        # (a request that waits that long computes locally).
        self._fetch_lock = threading.Lock()
        self._fetch_cv = threading.Condition(self._fetch_lock)
        self._fetch_jobs: OrderedDict[str, list[bytes]] = OrderedDict()   # req id -> hashes
        self._fetched: OrderedDict[str, dict[bytes, bytes]] = OrderedDict()
        self._fetching: str | None = None
        self._max_prefetched = max_prefetched
        # counters for metrics and tests (see KVConnectorStats; the blocks loaded are counted
        # by the scheduler: external_hit_tokens)
        self.blocks_stored = 0
        self.stores_dropped = 0
        self.prefetches_started = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.prefetches_skipped = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-share-store", daemon=True)
        self._thread.start()
        self._fetcher = threading.Thread(target=self._run_fetches, name="kv-share-fetch",
                                         daemon=True)
        self._fetcher.start()

    def key(self, block_hash: bytes) -> str:
        return self.prefix + hash_hex(block_hash)

    # ---- engine thread -----------------------------------------------------------------------
    def prefetch(self, req_id: str, hashes: list[bytes]) -> None:
        """Queue a background MGET of `hashes` for a waiting request; never blocks."""
        if not hashes:
            return
        if not self.breaker.closed_or_due():
            self.prefetches_skipped += 1
            return
        with self._fetch_cv:
            if len(self._fetch_jobs) >= self._max_prefetched:
                self.prefetches_skipped += 1
                return
            self._fetch_jobs[req_id] = list(hashes)
            self.prefetches_started += 1
            self._fetch_cv.notify()

    def lookup(self, req_id: str, hashes: list[bytes]) -> list[bytes]:
        """KV bytes of the longest run of `hashes` (from the first) that the prefetch for
        `req_id` already brought in; never waits for Redis."""
        with self._fetch_lock:
            got = self._fetched.get(req_id)
        found: list[bytes] = []
        for h in hashes if got else ():
            v = got.get(h)
            if v is None:
                break
            found.append(v)
        return found

    def ready(self, req_id: str) -> bool:
        with self._fetch_lock:
            return req_id not in self._fetch_jobs and self._fetching != req_id

    def release(self, req_id: str) -> None:
        with self._fetch_lock:
            self._fetch_jobs.pop(req_id, None)
            self._fetched.pop(req_id, None)
            if self._fetching == req_id:
                self._fetching = None         # the fetcher drops its answer

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until queued prefetches are done (tests; the engine never waits)."""
        deadline = time.monotonic() + timeout
        with self._fetch_cv:
            while self._fetch_jobs or self._fetching is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._fetch_cv.wait(min(left, 0.05))
        return True

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(self.prefetches_started, self.prefetch_hits, self.prefetch_misses,
                                self.prefetches_skipped, self.blocks_stored, self.stores_dropped,
                                self.errors, self.breaker.is_open, self.breaker.opens)

    def wants(self, block_hash: bytes) -> bool:
        """False for a block already stored by this engine (no second copy is sent)."""
        return block_hash not in self._stored

    def save(self, block_hash: bytes, data: bytes) -> None:
        """Queue one block's bytes for writing; never blocks (drops when the queue is full)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"block of {len(data)} bytes; this layout has {self.block_bytes}")
        self._remember(block_hash)
        try:
            self._pending.put_nowait((block_hash, data))
        except queue.Full:
            self.stores_dropped += 1
            self._stored.pop(block_hash, None)

    def flush(self) -> None:
        """Wait until queued stores are written (tests)."""
        self._pending.join()

    def close(self) -> None:
        self._stop.set()
        with self._fetch_cv:
            self._fetch_cv.notify_all()
        try:
            self._pending.put_nowait(None)
        except queue.Full:
            pass              # the writer sees _stop after its current item
        self._thread.join(2.0)
        self._fetcher.join(2.0)
        self._client.close()

    # ---- background reader ---------------------------------------------------------------------
    def _run_fetches(self) -> None:
        while not self._stop.is_set():
            with self._fetch_cv:
                self._fetching = None
                self._fetch_cv.notify_all()
                while not self._fetch_jobs and not self._stop.is_set():
                    self._fetch_cv.wait(0.5)
                if self._stop.is_set():
                    return
                req_id, hashes = self._fetch_jobs.popitem(last=False)
                self._fetching = req_id
            values = self._mget(hashes)
            with self._fetch_lock:
                got = {h: v for h, v in zip(hashes, values or ())
                       if v is not None and len(v) == self.block_bytes}
                if got:
                    self.prefetch_hits += 1
                elif values is not None:          # None: not sent (counted as skipped)
                    self.prefetch_misses += 1
                if self._fetching != req_id:
                    continue                  # released while fetching
                if got:
                    self._fetched[req_id] = got
                    while len(self._fetched) > self._max_prefetched:
                        self._fetched.popitem(last=False)

    def _mget(self, hashes: list[bytes]) -> list | None:
        """The values (None each where missing), [] when Redis failed, None when the breaker
        kept the call from going out."""
        if not self.breaker.allow():
            self.prefetches_skipped += 1
            return None
        try:
            values = self._client.mget([self.key(h) for h in hashes])
        except redis.RedisError as e:
            self._on_error(e)
            return []
        self._on_success()
        return values

    # ---- background writer ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._pending.get()
            try:
                if item is None:
                    return
                block_hash, data = item
                if not self.breaker.allow():
                    self.stores_dropped += 1
                    self._stored.pop(block_hash, None)
                    continue
                try:
                    self._client.set(self.key(block_hash), data, ex=self.ttl_s, nx=True)
                    self.blocks_stored += 1
                    self._on_success()
                except redis.RedisError as e:
                    self._on_error(e)
                    self._stored.pop(block_hash, None)
            finally:
                self._pending.task_done()

    def _remember(self, block_hash: bytes) -> None:
        self._stored[block_hash] = None
        self._stored.move_to_end(block_hash)
        if len(self._stored) > self._stored_cap:
            self._stored.popitem(last=False)

    def _on_success(self) -> None:
        self._outage_logged = False
        self.breaker.success()

    def _on_error(self, e: Exception) -> None:
        self.errors += 1
        self.breaker.failure()
        if not self._outage_logged:
            logger.warning("KV sharing: Redis unavailable (%s); computing locally until it is back", e)
            self._outage_logged = True
