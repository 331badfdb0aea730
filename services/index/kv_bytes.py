"""Cross-pod KV bytes (`--kv-share redis`): full prefix blocks stored in Redis, loaded by any pod.
The engine's KVConnector (engine/kv_connector.py); key names come from layout.py.

An engine that completes a prompt stores the KV bytes of its full blocks under a key naming the
model, dtype, cache layout and the chained block hash; an engine that misses locally but finds
the following blocks in Redis loads them instead of recomputing. The chained hash pins the whole
prefix, so loaded bytes are exactly what this engine would compute: greedy outputs stay identical.

NOTE: Redis trouble never reaches the engine: lookups answer 0 and stores are dropped while it
is down (logged once per outage); writes happen on a background thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.common.block_hash import hash_hex
from kvmesh.engine.kv_connector import KVConnector
from kvmesh.index.layout import KeySpace

logger = logging.getLogger("kvmesh.index.kv_bytes")


class RedisKVStore(KVConnector):
    def __init__(self, redis_url: str, model: str, dtype: str, layout: tuple[int, ...],
                 namespace: str | None = None, service: str | None = None,
                 password: str | None = None, ttl_s: int = 3600, max_pending: int = 512,
                 socket_timeout_s: float = 1.0) -> None:
        self.block_bytes = 1
        for d in layout:
            self.block_bytes *= d
        self.prefix = KeySpace.from_env(namespace, service).kv_bytes_prefix(model, dtype, layout)
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(redis_url, password=password,
                                            socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stored: OrderedDict[bytes, None] = OrderedDict()   # hashes known to be in Redis
        self._stored_cap = 65536
        self._outage_logged = False
        # counters for metrics and tests
        self.blocks_stored = 0          # (loads are counted by the scheduler: external_hit_tokens)
        self.stores_dropped = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-share-store", daemon=True)
        self._thread.start()

    def key(self, block_hash: bytes) -> str:
        return self.prefix + hash_hex(block_hash)

    # ---- engine thread -----------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[bytes]:
        """KV bytes of the longest run of `hashes` (from the first) found in Redis."""
        if not hashes:
            return []
        try:
            values = self._client.mget([self.key(h) for h in hashes])
        except redis.RedisError as e:
            self._on_error(e)
            return []
        self._outage_logged = False
        found: list[bytes] = []
        for v in values:
            if v is None or len(v) != self.block_bytes:
                break
            found.append(v)
        return found

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
        self._pending.put(None)
        self._thread.join(2.0)
        self._client.close()

    # ---- background writer ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._pending.get()
            try:
                if item is None:
                    return
                block_hash, data = item
                try:
                    self._client.set(self.key(block_hash), data, ex=self.ttl_s, nx=True)
                    self.blocks_stored += 1
                    self._outage_logged = False
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

    def _on_error(self, e: Exception) -> None:
        self.errors += 1
        if not self._outage_logged:
            logger.warning("KV sharing: Redis unavailable (%s); computing locally until it is back", e)
            self._outage_logged = True
