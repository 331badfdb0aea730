"""KVConnector: the engine's one seam to a store of KV blocks outside this pod (step 4 of issue 11).

    Scheduler.add_request ─────▶ connector.prefetch(req_id, hashes)   fetched in the background
    Scheduler._remote_blocks ──▶ connector.lookup(req_id, hashes)  what has arrived, never waits
    Scheduler (admitted/ended) ▶ connector.release(req_id)
    ModelRunner.execute ───────▶ connector.save_computed_prompts(scheduled, ...)   after the forward
                                  pass: wants(h) / save(h, bytes) for each completed prompt block
    its owner, when done ─────▶ connector.close()

Prefill/decode disaggregation (`--kv-transfer-config`, kvmesh.engine.kv_transfer) adds the
hooks of a hand-off between two engines (vLLM's connector names in brackets), all no-ops here:

    Scheduler._schedule_waiting ▶ wants_remote_prefill(req) [get_num_new_matched_tokens]
                                  start_load(req, block ids, first block)  read in the background
    Scheduler.schedule ────────▶ finished_loads() / take_released()   what arrived, pins to free
    Scheduler._finish ─────────▶ request_finished(req, block ids) [request_finished]: keep the
                                  prompt's blocks for a remote reader, and the response's params

Both sides key blocks by the chained block hash, which pins the whole prefix (cache salt
included), so bytes found under a hash are exactly what this engine would compute. Today's one
implementation is the Redis KV-bytes store (kvmesh.index.kv_bytes, `--kv-share redis`). The
engine never imports an implementation: whoever builds it (the server) passes a
`KVConnectorFactory`, which the engine calls once with what only it knows (`KVConnectorContext`).

NOTE: every call runs on the engine thread, so an implementation must never raise on a store
outage (answer "nothing found" and drop saves) and must do all network I/O off that thread: a
store that accepts connections and never answers must not stall a step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.engine.request import Request
    from kvmesh.engine.sched_output import ScheduledRequest


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

    # True for a prefill/decode hand-off connector: the scheduler then calls the hooks below
    handoff: bool = False

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

    def save_computed_prompts(self, scheduled: Iterable[ScheduledRequest], block_size: int,
                              read_block: Callable[[int], bytes]) -> None:
        """Offer the full blocks of every prompt whose KV the step just computed to the store
        (the blocks it wants; `read_block(block id)` gives one block's bytes). The runner
        calls it after the forward pass (vLLM's worker side of a connector saves there too).

        NOTE: only a prompt's first completion is offered: its n > 1 forks share the blocks.
        It runs before the step's results come back to the scheduler, while each
        ScheduledRequest still names its blocks (a request may finish, and free them, then)."""
        for sr in scheduled:
            req = sr.request
            if not sr.sample or req.num_output_tokens or req.sample_index:
                continue
            # NOTE: the scheduler's hasher has hashed every full prompt block since add_request
            for i in range(req.num_prompt_tokens // block_size):
                h = req.block_hashes[i]
                if self.wants(h):
                    self.save(h, read_block(sr.block_ids[i]))

    # ---- prefill/decode hand-off (kv_transfer/connector.py); nothing to do for a store -----
    def wants_remote_prefill(self, req: Request) -> bool:
        """True when `req`'s prompt KV is to be read from a remote engine before it runs."""
        return False

    def start_load(self, req: Request, block_ids: list[int], first_block: int) -> None:
        """Read prompt blocks first_block.. of `req` into `block_ids` (allocated, not yet in the
        prefix cache) off the step thread; finished_loads() reports the outcome. With no
        block ids (the prefix cache holds them all) it only tells the remote side it is done."""

    def finished_loads(self) -> list[LoadResult]:
        """The loads that ended since the last call (each reported once)."""
        return []

    def take_released(self) -> list[str]:
        """KV-manager table keys of pinned blocks to free now (read, or timed out)."""
        return []

    def request_finished(self, req: Request, block_ids: list[int]) -> FinishedTransfer | None:
        """`req` finished (not aborted) holding `block_ids`: a FinishedTransfer keeps its first
        blocks under a new table key for a remote reader; None frees them as usual."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop background work and release connections."""

    def stats(self) -> KVConnectorStats:
        """Counters since start (read from any thread, e.g. a /metrics scrape)."""
        return KVConnectorStats()


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How one remote read ended (the consumer side of a hand-off)."""
    request_id: str
    ok: bool                # False: the request computes its prompt here instead
    num_blocks: int         # blocks read (0 when it failed)


@dataclass(frozen=True, slots=True)
class FinishedTransfer:
    """What a finished producer request leaves behind (the producer side of a hand-off)."""
    key: str                # the KV manager's table key that keeps the blocks referenced
    num_blocks: int         # the table's first blocks kept: the prompt's full blocks
    params: dict            # the response's kv_transfer_params


@dataclass(frozen=True, slots=True)
class KVConnectorContext:
    """What a connector learns from the engine that builds it: bytes are only shared between
    identical weights and block layouts."""
    model: str                      # fingerprint of the loaded weights (not the served name)
    dtype: str                      # KV-cache dtype, e.g. "float32"
    block_layout: tuple[int, ...]   # the runner's shape of one block, plus the item size


KVConnectorFactory = Callable[[KVConnectorContext], KVConnector]
