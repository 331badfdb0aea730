"""The scheduler's side of a prefill/decode hand-off: requests whose prompt KV is read from
another engine (consumer) and prompts kept for another engine to read (producer).

The scheduler owns the queues and decides *when*; a `Handoff` does the blocks' side, as the
Preemptor does for preemption:

    waiting ─ start(req) ─▶ loading (blocks allocated for the remote prompt blocks, not cached,
                 │           not scheduled; the connector reads them off the step thread)
                 └─ poll() ─┬▶ read: computed up to them ─▶ running (the prompt's tail runs here)
                            └▶ failed: blocks freed, computed 0 ─▶ waiting (a local prefill)
    finish(req) ─▶ producer: the prompt's full blocks stay referenced under a pin key until
                   the reader is done or the pin times out (take_released frees them)

NOTE: a request aborted while its read is in flight, or whose read ran past its deadline,
leaves its blocks parked under a key until the read ends: the transfer may still be writing
into them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_connector import KVConnector
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sched_output import SchedulerStats

logger = logging.getLogger("kvmesh.engine.kv_transfer")


@dataclass(slots=True)
class PollResult:
    ready: list[Request]        # their remote KV arrived: to the running queue
    failed: list[Request]       # to compute their prompt locally: back to the waiting queue


class Handoff:
    def __init__(self, kv: KVCacheManager, connector: KVConnector) -> None:
        self.kv = kv
        self.connector = connector
        self.loading: dict[str, Request] = {}     # request id -> request whose KV is being read
        self._parked: dict[str, str] = {}         # aborted or given up mid-read: id -> table key
        self._num_parked = 0
        # NOTE: one read per request: a failed one is computed here, also after a preemption
        self._tried: set[str] = set()
        # a read not ended after this long is given up: computed here (None: no bound)
        self.timeout_s: float | None = getattr(connector, "load_timeout_s", None)
        self._deadlines: dict[str, float] = {}    # request id -> when its read is given up
        self.num_timeouts = 0

    def wants(self, req: Request) -> bool:
        """True when `req` waits for its prompt KV from another engine (first time only)."""
        return req.request_id not in self._tried and self.connector.wants_remote_prefill(req)

    def start(self, req: Request, now: float) -> bool | None:
        """Begin reading `req`'s remote prompt blocks. True: it is loading (off every queue);
        False: nothing to read (its prefix cache holds them all), admit it as usual; None:
        no free blocks for them now."""
        kv, bs = self.kv, self.kv.block_size
        hits, num_hit = kv.get_computed_blocks(req)
        first, limit = num_hit // bs, (req.num_tokens - 1) // bs   # one token is computed here
        if first >= limit:
            self._tried.add(req.request_id)
            self.connector.start_load(req, [], first)
            return False
        if kv.allocate_slots(req, (limit - first) * bs, hits, num_hit, cache=False) is None:
            return None
        self._tried.add(req.request_id)
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = req
        if self.timeout_s is not None:
            self._deadlines[req.request_id] = now + self.timeout_s
        self.connector.start_load(req, kv.get_block_ids(req.request_id)[first:limit], first)
        return True

    def poll(self, stats: SchedulerStats, now: float) -> PollResult:
        """The reads that ended: ready requests (computed up to the read blocks) and failed
        ones (blocks freed, to be computed here). Parked blocks of aborted reads are freed;
        reads past their deadline are given up (their requests fail, their blocks park)."""
        out = PollResult([], [])
        bs = self.kv.block_size
        for res in self.connector.finished_loads():
            key = self._parked.pop(res.request_id, None)
            if key is not None:
                self.kv.free(key)
                continue
            req = self.loading.pop(res.request_id, None)
            self._deadlines.pop(res.request_id, None)
            if req is None:
                continue
            if res.ok:
                req.num_computed_tokens = len(self.kv.block_table(req.request_id)) * bs
                stats.external_hit_tokens += res.num_blocks * bs
                req.status = RequestStatus.RUNNING
                out.ready.append(req)
            else:
                logger.warning("request %s: reading its prompt KV failed; computing it here",
                               req.request_id)
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                out.failed.append(req)
        for rid in [r for r, t in self._deadlines.items() if t <= now]:
            del self._deadlines[rid]
            req = self.loading.pop(rid)
            logger.warning("request %s: reading its prompt KV took over %.1f s; computing it "
                           "here", rid, self.timeout_s)
            self.num_timeouts += 1
            self._park(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            out.failed.append(req)
        for key in self.connector.take_released():
            self.kv.free(key)
        return out

    def _park(self, req: Request) -> None:
        """Keep a request's blocks referenced under a key until its read ends (it may still
        write into them); the request itself holds none after this."""
        self._num_parked += 1
        key = f"kv-transfer-parked:{self._num_parked}"
        self.kv.pin(req, len(self.kv.block_table(req.request_id)), key)
        self._parked[req.request_id] = key

    def finish(self, req: Request, status: RequestStatus) -> bool:
        """Blocks of a request finishing with `status`: True when they were parked or pinned
        (the caller must not free them), False to free them as usual."""
        rid = req.request_id
        self._tried.discard(rid)
        if self.loading.pop(rid, None) is not None:
            self._deadlines.pop(rid, None)
            self._park(req)
            return True
        kept = None
        if status != RequestStatus.FINISHED_ABORTED:
            kept = self.connector.request_finished(req, self.kv.get_block_ids(rid))
        if kept is None:
            return False
        self.kv.pin(req, kept.num_blocks, kept.key)
        req.kv_transfer_result = kept.params
        return True
