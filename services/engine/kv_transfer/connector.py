"""MooncakeConnector: the scheduler's KVConnector for a prefill/decode hand-off.

    producer (kv_producer | kv_both)                consumer (kv_consumer | kv_both)
    request_finished: pin the prompt's full         wants_remote_prefill / start_load: a LoadJob
      blocks, answer kv_transfer_params               to the Loader thread (side channel query,
    side channel: /query (layout, blocks,             hash check, Mooncake batch read, /done)
      hashes), /done -> take_released frees them    finished_loads: what ended
    pins nobody read expire (counted)

Both register the whole KV cache tensor with Mooncake once, at start: a producer's blocks are
read in place, a consumer's are written in place (no staging copy).
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.common.kv_transfer_config import KVTransferConfig
from kvmesh.engine.kv_connector import FinishedTransfer, KVConnector, LoadResult
from kvmesh.engine.kv_transfer.layout import KVLayout
from kvmesh.engine.kv_transfer.loader import Loader, LoadJob, Transfer
from kvmesh.engine.kv_transfer.mooncake import MooncakeTransfer
from kvmesh.engine.kv_transfer.params import KVTransferParams
from kvmesh.engine.kv_transfer.pins import PinTable
from kvmesh.engine.kv_transfer.side_channel import SideChannel
from kvmesh.engine.request import Request

logger = logging.getLogger("kvmesh.engine.kv_transfer")


@dataclass(frozen=True, slots=True)
class KVTransferStats:
    """Totals since start, for /metrics (kvmesh:kv_transfer_*)."""
    bytes_read: int = 0             # KV bytes this engine read from producers
    seconds: float = 0.0            # time spent in reads (side channel round trips included)
    transfers: int = 0              # reads that succeeded
    failures: int = 0               # reads that failed (the prompt was computed here)
    pinned_blocks: int = 0          # blocks held now for remote readers (a gauge)
    pin_timeouts: int = 0           # pins freed unread after pinned_timeout_s
    pins_released: int = 0          # pins freed after the reader was done
    read_seconds: float = 0.0       # time inside Mooncake's reads alone (successful reads): the
                                    # wire rate is bytes_read / read_seconds


def kv_layout(kv_cache: torch.Tensor) -> KVLayout:
    """The layout of the runner's cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    assert kv_cache.is_contiguous(), "the KV cache must be one contiguous tensor"
    layers, two, num_blocks = kv_cache.shape[:3]
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    return KVLayout(kv_cache.data_ptr(), layers * two, num_blocks, block_bytes,
                    str(kv_cache.dtype).removeprefix("torch."))


class MooncakeConnector(KVConnector):
    handoff = True
    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, block_size: int) -> None:
        if kv_cache.device.type != "cpu":
            # NOTE: the non-CUDA Mooncake build registers host memory only
            raise ValueError("--kv-transfer-config: this build moves KV between host-memory caches "
                             "(CPU engines); a CUDA cache needs Mooncake's CUDA build or NIXL")
        self.config = config
        self.block_size = block_size
        # the scheduler gives a read up after this long (the request is then computed here)
        self.load_timeout_s = config.transfer_timeout_s
        self.layout = kv_layout(kv_cache)
        self._kv_cache = kv_cache                    # NOTE: keeps the registered memory alive
        self.transfer = MooncakeTransfer(config.kv_ip, config.protocol, config.device_name)
        self.transfer.register(self.layout.base_addr, self.layout.num_regions
                               * self.layout.region_bytes)
        self._lock = threading.Lock()
        self._bytes = self._transfers = self._failures = 0
        self._seconds = 0.0
        self._read_seconds = 0.0
        # called with every finished read, on the loader thread (metrics, tracing)
        self.transfer_listeners: list[Callable[[Transfer], None]] = []
        self.pins: PinTable | None = None
        self.side_channel: SideChannel | None = None
        self.loader: Loader | None = None
        self._keys = itertools.count(1)
        try:
            if config.is_producer:
                self.pins = PinTable(config.pinned_timeout_s)
                self.side_channel = SideChannel(config.kv_ip, config.kv_port, self.pins,
                                                self._describe)
            if config.is_consumer:
                self.loader = Loader(self.transfer.read, self.layout, config.transfer_timeout_s,
                                     self._record)
        except BaseException:
            self.close()
            raise
        logger.info("KV transfer: %s %s, Mooncake %s at %s%s", config.kv_role, config.engine_id,
                    config.protocol, self.transfer.rpc_addr,
                    f", side channel {self.side_channel.addr}" if self.side_channel else "")

    def _describe(self) -> dict:
        return {"engine_id": self.config.engine_id, "rpc_addr": self.transfer.rpc_addr,
                "layout": self.layout.to_dict()}

    def _record(self, t: Transfer) -> None:
        with self._lock:
            self._seconds += t.seconds
            if t.ok:
                self._bytes += t.num_bytes
                self._transfers += 1
                self._read_seconds += t.read_seconds
            else:
                self._failures += 1
        for listener in list(self.transfer_listeners):
            try:
                listener(t)
            except Exception:  # noqa: BLE001 - an observer's bug must not stop the reads
                logger.exception("a KV-transfer listener failed")

    # ---- the store interface (--kv-share): nothing stored, nothing fetched ------------------
    def prefetch(self, req_id: str, block_hashes: list[bytes]) -> None:
        pass

    def lookup(self, req_id: str, block_hashes: list[bytes]) -> list[bytes]:
        return []

    def release(self, req_id: str) -> None:
        pass

    def wants(self, block_hash: bytes) -> bool:
        return False

    def save(self, block_hash: bytes, data: bytes) -> None:
        pass

    # ---- consumer ------------------------------------------------------------------------
    def wants_remote_prefill(self, req: Request) -> bool:
        kt = req.sampling_params.kv_transfer_params
        return self.loader is not None and kt is not None and kt.do_remote_prefill

    def start_load(self, req: Request, block_ids: list[int], first_block: int) -> None:
        kt: KVTransferParams = req.sampling_params.kv_transfer_params
        n = len(block_ids)
        self.loader.submit(LoadJob(
            req.request_id, kt.remote_bootstrap_addr, kt.remote_engine_id, kt.transfer_id,
            tuple(block_ids), first_block,
            tuple(h.hex() for h in req.block_hashes[first_block:first_block + n])))

    def finished_loads(self) -> list[LoadResult]:
        return self.loader.take_finished() if self.loader is not None else []

    # ---- producer ------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> FinishedTransfer | None:
        kt = req.sampling_params.kv_transfer_params
        if self.pins is None or kt is None or not kt.do_remote_decode:
            return None
        tid = kt.transfer_id or f"xfer-{req.request_id}"
        n = min(req.num_prompt_tokens // self.block_size, len(block_ids))
        key = f"kv-transfer-pin:{next(self._keys)}"
        if n:
            self.pins.pin(tid, key, block_ids[:n], req.block_hashes[:n])
        params = KVTransferParams(do_remote_decode=False, do_remote_prefill=True,
                                  remote_engine_id=self.config.engine_id,
                                  remote_bootstrap_addr=self.side_channel.addr,
                                  remote_block_ids=tuple(block_ids[:n]), transfer_id=tid)
        return FinishedTransfer(key, n, params.to_dict())

    def take_released(self) -> list[str]:
        return self.pins.take_released() if self.pins is not None else []

    # ---- both ----------------------------------------------------------------------------
    def transfer_stats(self) -> KVTransferStats:
        with self._lock:
            read = (self._bytes, self._seconds, self._transfers, self._failures)
            read_seconds = self._read_seconds
        pins = self.pins
        return KVTransferStats(*read, pins.num_pinned_blocks if pins else 0,
                               pins.num_timeouts if pins else 0,
                               pins.num_released if pins else 0, read_seconds)

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None
        if self.loader is not None:
            self.loader.close()
            self.loader = None
