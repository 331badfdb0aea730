"""Mooncake's transfer engine, the one place kvmesh calls it: start, register memory, read.

`mooncake-transfer-engine-non-cuda` (the `pd` extra) in P2PHANDSHAKE mode needs no metadata
server: a peer is named by "ip:rpc_port". Its TCP transport moves bytes between processes (one
machine or several); on RDMA NICs the same calls use the "rdma" protocol.
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger("kvmesh.engine.kv_transfer")


class MooncakeError(RuntimeError):
    """Mooncake is missing, or refused to start or to register memory."""


class MooncakeTransfer:
    """One transfer engine of this process: the memory it registered and reads into it."""

    def __init__(self, hostname: str, protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine  # noqa: PLC0415 - an optional extra
        except ImportError as e:
            raise MooncakeError(
                "--kv-transfer-config needs Mooncake's transfer engine: pip install "
                "'kvmesh[pd]' (and apt-get install libibverbs1 librdmacm1 libnuma1); "
                f"import failed: {e}") from None
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise MooncakeError(f"Mooncake's transfer engine did not start on {hostname} "
                                f"({protocol}): status {rc}")
        self.hostname = hostname
        self.rpc_port: int = self._engine.get_rpc_port()
        # NOTE: one read at a time per engine object: the loader has one thread, and the
        # binding's thread safety is not documented
        self._lock = threading.Lock()

    @property
    def rpc_addr(self) -> str:
        """How peers name this engine ("ip:port")."""
        return f"{self.hostname}:{self.rpc_port}"

    def register(self, addr: int, length: int) -> None:
        """Make [addr, addr + length) readable by peers and writable by reads (once, at start)."""
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise MooncakeError(f"Mooncake could not register {length} bytes of KV cache: "
                                f"status {rc}")

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> bool:
        """Copy remote[i] .. + lengths[i] of `peer` ("ip:port") to local[i], all in one batch;
        False when any part failed (the peer died or refused)."""
        with self._lock:
            return self._engine.batch_transfer_sync_read(peer, local, remote, lengths) == 0
