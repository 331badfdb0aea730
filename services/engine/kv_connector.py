"""KVConnector: the engine's one seam to a store of KV blocks outside this pod (step 4 of issue 11).

    Scheduler.add_request ─────▶ connector.prefetch(req_id, hashes)   fetched in the background
    Scheduler._remote_blocks ──▶ connector.lookup(req_id, hashes)  what has arrived, never waits
    Scheduler (admitted/ended) ▶ connector.release(req_id)
    LLMEngine._share_prompt_blocks ─▶ connector.wants(h) / connector.save(h, bytes)
    its owner, when done ─────▶ connector.close()

Both sides key blocks by the chained block hash, which pins the whole prefix (cache salt
included), so bytes found under a hash are exactly what this engine would compute. Today's one
implementation is the Redis KV-bytes store (kvmesh.index.kv_bytes, `--kv-share redis`);
`make_kv_connector` picks it from the engine config.

NOTE: every call runs on the engine thread, so an implementation must never raise on a store
outage (answer "nothing found" and drop saves) and must do all network I/O off that thread: a
store that accepts connections and never answers must not stall a step.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.common.config import EngineConfig


@dataclass(frozen=True, slots=True)
class KVConnectorStats:
    """A connector's counters since it started (totals), for /metrics."""
    prefetches_started: int = 0     # background fetches queued for waiting requests
    prefetch_hits: int = 0          # fetches that brought at least one block
    prefetch_misses: int = 0        # fetches that found none (the store failed or had none)
    prefetches_skipped: int = 0     # not sent: the breaker was open or too many were pending
    blocks_stored: int = 0          # blocks written to the store
    stores_dropped: int = 0         # blocks not written: queue full, breaker open or an error
    errors: int = 0                 # failed store round trips
    breaker_open: bool = False      # the store is being skipped after repeated failures
    breaker_opens: int = 0          # times the breaker opened


class KVConnector(ABC):
    """A store of full KV blocks shared between engines, keyed by chained block hash."""

    @abstractmethod
    def prefetch(self, req_id: str, block_hashes: list[bytes]) -> None:
        """Start fetching these blocks for a waiting request; never blocks the caller."""

    @abstractmethod
    def lookup(self, req_id: str, block_hashes: list[bytes]) -> list[bytes]:
        """KV bytes of the longest run of `block_hashes`, from the first, that a prefetch for
        `req_id` has already brought in ([] when none arrived yet, or the store is down).
        Never waits for the store."""

    def ready(self, req_id: str) -> bool:
        """False while a prefetch for `req_id` is still in flight (True when done, skipped or
        never asked for): the scheduler lets such a request wait a moment, never the step."""
        return True

    @abstractmethod
    def release(self, req_id: str) -> None:
        """Forget what was fetched for `req_id` (admitted, aborted or finished)."""

    @abstractmethod
    def wants(self, block_hash: bytes) -> bool:
        """False when saving this block again is pointless (this engine already sent it)."""

    @abstractmethod
    def save(self, block_hash: bytes, data: bytes) -> None:
        """Offer one computed block's bytes to the store; never blocks the caller."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work and release connections."""

    def stats(self) -> KVConnectorStats:
        """Counters since start (read from any thread, e.g. a /metrics scrape)."""
        return KVConnectorStats()


def make_kv_connector(config: EngineConfig, fingerprint: Callable[[], str], dtype: str,
                      block_layout: tuple[int, ...]) -> KVConnector | None:
    """The connector `config` asks for (None without --kv-share). `fingerprint` names the loaded
    weights (called only with --kv-share); `block_layout` is the runner's shape of one block plus
    item size: bytes are only shared between identical weights and layouts."""
    if not config.kv_share_url:
        return None
    from kvmesh.index.kv_bytes import RedisKVStore  # noqa: PLC0415 (only --kv-share needs redis)

    return RedisKVStore(config.kv_share_url, fingerprint(), dtype, block_layout,
                        password=os.environ.get("KVMESH_REDIS_PASSWORD"))
