"""The ranks' process group: gloo on CPU, NCCL on CUDA, built without torch.distributed's globals.

NOTE: a `ProcessGroupGloo` / `ProcessGroupNCCL` object over a TCPStore, not
`init_process_group`: the default group is one per process, and an engine process may build a
tensor-parallel engine after another (tests), or beside a single-rank one. Every collective has
the group's timeout, so a rank never waits forever on a peer that stopped answering; a peer that
died is seen at once (gloo: "Connection closed by peer").
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


class TPGroup:
    """One rank's handle on the N ranks of a tensor-parallel model.

    Created unconnected by the loader (the model's layers keep a reference); `connect` joins the
    others. Collectives are counted (calls, seconds, bytes sent) for the benchmark.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._pg: dist.ProcessGroup | None = None
        self.comm_calls = 0
        self.comm_seconds = 0.0      # rank 0's wall time inside collectives (waiting included)
        self.comm_bytes = 0          # this rank's payload into the collectives

    def connect(self, host: str, port: int, device: torch.device,
                timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None) -> None:
        """Rendezvous with the other ranks through the TCPStore at host:port (rank 0 serves it)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, self.size, self.rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
        self._store = store
        self.all_reduce(torch.zeros(1, device=device))      # fail here, not in the first step

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def _run(self, work, nbytes: int) -> None:
        # NOTE: gloo's wait() blocks until the collective is done, so comm_seconds is its wall
        # time; NCCL's only orders the stream (the time is then launch time, not transfer time).
        t0 = time.perf_counter()
        work.wait()
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        self.comm_bytes += nbytes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self._pg is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} used before its group connected")
        t = t.contiguous()
        self._run(self._pg.allreduce([t]), t.numel() * t.element_size())
        return t

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor | None:
        """Rank 0: the ranks' [R, C] shards side by side, cut to `width` columns; others: None."""
        if self._pg is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} used before its group connected")
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        self._run(self._pg.gather(outs, [t], opts), t.numel() * t.element_size())
        if self.rank != 0:
            return None
        return torch.cat(outs[0], dim=-1)[:, :width]

    def reset_counters(self) -> None:
        self.comm_calls, self.comm_seconds, self.comm_bytes = 0, 0.0, 0

    def close(self) -> None:
        """Drop the group (a failed peer leaves it unusable anyway)."""
        self._pg = None
        self._store = None
