"""The consumer's reads: one background thread takes load jobs, asks the producer's side
channel for the blocks, checks them against the request's prompt, reads them with Mooncake
(one batch: a read per contiguous run per layer's K and V) and tells the producer it is done.

Any failure (the producer gone, the pin timed out, another prompt, another layout, a transfer
error) is a failed load: the scheduler computes that prompt locally, never a wrong answer.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvmesh.engine.kv_connector import LoadResult
from kvmesh.engine.kv_transfer.layout import KVLayout, plan_reads
from kvmesh.engine.kv_transfer.side_channel import SideChannelError, notify_done, query

logger = logging.getLogger("kvmesh.engine.kv_transfer")


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: str
    bootstrap_addr: str         # the producer's side channel
    engine_id: str              # the producer's engine id, as the router named it
    transfer_id: str
    block_ids: tuple[int, ...]  # local blocks to fill ((): only tell the producer it is done)
    first_block: int            # the prompt's block index that block_ids[0] holds
    block_hashes: tuple[str, ...]  # the request's hashes of those blocks (hex), to check


@dataclass(frozen=True, slots=True)
class Transfer:
    """One finished read, for the metrics and the request's trace."""
    request_id: str
    transfer_id: str
    ok: bool
    num_blocks: int
    num_bytes: int
    start: float                # wall-clock seconds (time.time), for the span
    seconds: float
    error: str | None
    read_seconds: float = 0.0   # inside Mooncake's batch read alone (the wire part of `seconds`)


class LoadFailed(Exception):
    pass


class Loader:
    def __init__(self, read: Callable[[str, list[int], list[int], list[int]], bool],
                 layout: KVLayout, timeout_s: float,
                 on_transfer: Callable[[Transfer], None]) -> None:
        self._read = read               # MooncakeTransfer.read
        self.layout = layout            # this engine's cache
        self.timeout_s = timeout_s      # bound on each side-channel round trip
        self._on_transfer = on_transfer
        # NOTE: one client for every side-channel call, used by the loader thread alone
        self._http = httpx.Client()
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._done: list[LoadResult] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-loader", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def take_finished(self) -> list[LoadResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._http.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            start, t0 = time.time(), time.monotonic()
            nbytes, read_s, error = 0, 0.0, None
            try:
                nbytes, read_s = self._load(job)
            except LoadFailed as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - a load must always report, never kill the thread
                logger.exception("request %s: reading its prompt KV failed", job.request_id)
                error = repr(e)
            finally:
                # NOTE: also after a failure: the producer may free its blocks now
                notify_done(self._http, job.bootstrap_addr, job.transfer_id, self.timeout_s)
            ok = error is None
            if job.block_ids:
                if not ok:
                    logger.warning("request %s: transfer %s failed: %s", job.request_id,
                                   job.transfer_id, error)
                self._on_transfer(Transfer(job.request_id, job.transfer_id, ok,
                                           len(job.block_ids) if ok else 0, nbytes, start,
                                           time.monotonic() - t0, error, read_s))
            with self._lock:
                self._done.append(LoadResult(job.request_id, ok,
                                             len(job.block_ids) if ok else 0))

    def _load(self, job: LoadJob) -> tuple[int, float]:
        """Read the job's blocks; returns the bytes read and the seconds Mooncake's read took.
        LoadFailed says why not."""
        if not job.block_ids:
            return 0, 0.0
        try:
            info = query(self._http, job.bootstrap_addr, job.transfer_id, self.timeout_s)
        except SideChannelError as e:
            raise LoadFailed(str(e)) from None
        if info.get("engine_id") != job.engine_id:
            raise LoadFailed(f"{job.bootstrap_addr} is engine {info.get('engine_id')!r}, "
                             f"not {job.engine_id!r}")
        remote = KVLayout.from_dict(info["layout"])
        why = self.layout.compatible(remote)
        if why:
            raise LoadFailed(why)
        first, n = job.first_block, len(job.block_ids)
        remote_ids = info["block_ids"][first:first + n]
        if len(remote_ids) < n:
            raise LoadFailed(f"the producer holds {len(info['block_ids'])} blocks, "
                             f"{first + n} needed")
        if tuple(info["block_hashes"][first:first + n]) != job.block_hashes:
            raise LoadFailed("the producer's blocks hold another prompt (block hashes differ: "
                             "same --hash-seed, cache salt and adapter needed)")
        local, remote_addrs, lengths = plan_reads(self.layout, remote, list(job.block_ids),
                                                  remote_ids)
        t0 = time.monotonic()
        if not self._read(info["rpc_addr"], local, remote_addrs, lengths):
            raise LoadFailed(f"Mooncake read from {info['rpc_addr']} failed")
        return sum(lengths), time.monotonic() - t0
