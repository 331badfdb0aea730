"""Token-level continuous-batching scheduler: waiting / running / swapped queues.

Each step mixes decodes with (chunked) prefills under one token budget. Every request is just
"tokens known" vs "tokens computed": a prefill is many tokens to compute, a decode is one, a
recompute-preempted request is its prompt plus outputs. Layers are one-way:
scheduler -> KVCacheManager -> BlockPool.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kvmesh.common.block_hash import BlockHasher
from kvmesh.common.config import EngineConfig
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_connector import KVConnector
from kvmesh.engine.kv_transfer.handoff import Handoff
from kvmesh.engine.sched_policy import Policy, make_policy
from kvmesh.engine.request import FINISHED_STATUSES as _FINISHED, Logprob, Request, RequestStatus
from kvmesh.engine.sched_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                        SchedulerStats)
from kvmesh.engine.preemption import Preemptor
from kvmesh.engine.prompt_logprobs import record_prompt_logprobs
from kvmesh.engine.spec_decode.speculator import Speculator
from kvmesh.engine.step_state import StepState

if TYPE_CHECKING:
    from kvmesh.engine.structured.manager import StructuredOutputManager

_KV_COUNTERS = ("blocks_allocated", "blocks_freed", "blocks_evicted", "cow_copies",
                "prefix_queries", "prefix_hits")


# seconds a new request may wait for its cross-pod KV prefetch before it is computed locally
# (a failed or timed-out fetch ends the wait sooner: the store's socket timeout is 1 s)
REMOTE_KV_WAIT_S = 2.0

_NO_DRAFTS: tuple[int, ...] = ()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _makes_placeholder(sr: ScheduledRequest) -> bool:
    """Whether the step samples a token for this request (async scheduling's placeholder)."""
    return sr.sample and sr.request.pooling is None


def _count_scheduled(stats: SchedulerStats, sr: ScheduledRequest, sign: int) -> None:
    """Add (sign +1) or take back (-1, a victim's tokens) one scheduled request's counts."""
    if sr.is_decode:
        stats.num_decode_reqs += sign
    else:
        stats.num_prefill_reqs += sign
        if not sr.sample:
            stats.num_chunked_prefills += sign
    stats.num_scheduled_tokens += sign * sr.num_tokens
    prompt_left = sr.request.num_prompt_tokens - sr.start
    if prompt_left > 0:
        stats.num_prompt_tokens_computed += sign * min(prompt_left, sr.num_tokens)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        block_bytes: int,                       # bytes of one block across all layers (K and V)
        clock: Callable[[], float] = time.monotonic,
        policy: Policy | None = None,
        kv_connector: KVConnector | None = None,   # cross-pod KV blocks (--kv-share redis)
        # structured outputs: the step's grammar bitmask and each new token's acceptance
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.policy = policy or make_policy(config)
        self.kv_connector = kv_connector
        self.structured = structured
        # NOTE: the one place block hashes come from: every request gets this hasher at
        # add_request and extends its own block_hashes as tokens are appended; the prefix cache
        # and the connector (prefetch, lookups, saves) only read them. Nobody needs hashes
        # with prefix caching off and no connector.
        self.block_hasher: BlockHasher | None = (
            BlockHasher(kv.block_size, config.hash_seed)
            if kv.enable_caching or kv_connector is not None else None)
        self.token_budget = config.token_budget(max_model_len)
        self.chunked = config.enable_chunked_prefill
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.pending_forks: dict[str, list[Request]] = {}   # sample 0 id -> samples 1..n-1
        self.requests: dict[str, Request] = {}              # every live request, forks included
        self._awaiting_kv: set[str] = set()                 # waiting for their KV prefetch
        # NOTE: no per-request object per step: each live request's ScheduledRequest is
        # refilled whenever it is scheduled, and with a static policy (fcfs, priority) a queue
        # is sorted only after a request joined it. At 1024 running requests the per-step
        # records and sort keys set off several collections a step.
        self._records: dict[str, ScheduledRequest] = {}
        # --async-scheduling: step n's records are still read (update_from_output) after step
        # n + 1 is scheduled, so consecutive steps fill two alternating sets
        self.async_scheduling = config.async_scheduling
        self._records_prev: dict[str, ScheduledRequest] = {}
        self._running_unsorted = self._waiting_unsorted = True
        self.step_id = 0
        # NOTE: block counters at the end of the last step: every block operation, aborts
        # between steps and frees at finish included, is counted in exactly one step's stats.
        self._kv_mark = self._kv_counters()
        # NOTE: the auto preemption mode compares the two rates; update_from_output refines
        # the prefill rate from each step's measured forward pass.
        self.preemptor = Preemptor(kv, block_bytes, config.recompute_tokens_per_s,
                                   config.swap_bytes_per_s)
        # --speculative-config: drafts for decodes, and what their verification accepted
        self.speculator: Speculator | None = (
            Speculator(config.speculative_config) if config.speculative_config else None)
        # --kv-transfer-config: prompts read from a prefill engine, prompts kept for a decode one
        self.handoff: Handoff | None = (Handoff(kv, kv_connector)
                                        if getattr(kv_connector, "handoff", False) else None)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.set_block_hasher(self.block_hasher)
        request.status = (RequestStatus.WAITING_FOR_GRAMMAR if request.grammar is not None
                          else RequestStatus.WAITING)
        self._join(self.waiting, request)
        self._prefetch_remote(request)

    def add_fork(self, parent: Request, child: Request) -> None:
        """Register sample i > 0 of an n > 1 request; it starts when the parent's prefill ends."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        child.set_block_hasher(self.block_hasher)
        child.status = RequestStatus.WAITING_FOR_FORK
        self.pending_forks.setdefault(parent.request_id, []).append(child)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests as aborted, wherever they are; their blocks are freed at once."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            for child in self.pending_forks.pop(rid, []):
                self._finish(child, RequestStatus.FINISHED_ABORTED)
                aborted.append(child)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def finish_request(self, req: Request, status: RequestStatus, stop_reason=None) -> None:
        """Finish a live request (the output stage found a stop)."""
        if req.request_id in self.requests:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        queue = {RequestStatus.WAITING: self.waiting, RequestStatus.WAITING_FOR_GRAMMAR: self.waiting,
                 RequestStatus.RUNNING: self.running,
                 RequestStatus.SWAPPED: self.swapped}.get(req.status)
        if queue is not None:
            queue.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_FORK and req.parent_id is not None:
            for siblings in self.pending_forks.values():
                if req in siblings:
                    siblings.remove(req)
        if self.handoff is None or not self.handoff.finish(req, status):
            self.kv.free(req)
        req.status = status
        self.requests.pop(req.request_id, None)
        self._records.pop(req.request_id, None)
        self._records_prev.pop(req.request_id, None)
        self._awaiting_kv.discard(req.request_id)
        if self.kv_connector is not None:
            self.kv_connector.release(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        if self.async_scheduling:
            self._records, self._records_prev = self._records_prev, self._records
        now = self.clock()
        st = StepState(self.step_id, now, lambda r: self.policy.key(r, now), self.token_budget,
                       SchedulerStats(step=self.step_id, policy=self.policy.name,
                                      token_budget=self.token_budget))
        if self.handoff is not None:
            self.poll_handoff(st.stats)
        self._schedule_running(st)
        self._schedule_swapped(st)
        self._schedule_waiting(st)
        self._commit(st)
        out = st.output()
        if self.structured is not None:
            out.grammar = self.structured.bitmask(out)
        return out

    def poll_handoff(self, stats: SchedulerStats) -> None:
        """P/D: requests whose remote prompt KV arrived run (those whose read failed wait
        for a local prefill); pins read or timed out are freed. Also called while idle."""
        polled = self.handoff.poll(stats, self.clock())
        for req in polled.ready:
            self._join(self.running, req)
        for req in polled.failed:
            self._join(self.waiting, req)

    def _schedule_running(self, st: StepState) -> None:
        """1) Running requests, best first. When blocks run out, the worst running request is
        preempted (possibly the one being scheduled). Victims always come from behind."""
        if self._running_unsorted or not self.policy.static:
            self.running.sort(key=st.key)
            self._running_unsorted = False
        # NOTE: the per-request body is this step's hot loop (every running request, every
        # step): attributes bound to locals (benchmarks/scheduler_step.py)
        running, kv = self.running, self.kv
        allocate, num_new_tokens = kv.allocate_slots, self._num_new_tokens
        spec = self.speculator
        if spec is not None:
            spec.begin_step(len(running))
        i = 0
        while i < len(running) and st.budget > 0:
            req = running[i]
            num_new = num_new_tokens(req, st.budget)
            if num_new == 0:
                i += 1
                continue
            drafts = _NO_DRAFTS
            if (spec is not None and num_new == 1
                    and len(req.all_token_ids) == req.num_computed_tokens + 1):   # a decode
                drafts = self._draft_slots(req, st.budget - 1, len(running) - i - 1)
            if drafts:
                num_new += len(drafts)
            else:
                while allocate(req, num_new) is None:
                    victim = running[-1]
                    self._preempt(victim, st)
                    if victim is req:
                        break
                else:
                    victim = None
                if victim is req:
                    continue
            if kv.has_copies:
                self._drain_copies(st)
            self._schedule_tokens(req, num_new, st, drafts)
            i += 1

    def _draft_slots(self, req: Request, budget: int, num_behind: int) -> Sequence[int]:
        """A decode's drafts with KV slots allocated for its token and them; none (nothing
        allocated) when it gets none or they do not fit.

        NOTE: drafts never preempt anyone: they take slots only while a free block is left
        for each running request still to be scheduled in this step."""
        drafts = self.speculator.propose(req, budget)
        if not drafts:
            return _NO_DRAFTS
        kv = self.kv
        need = _cdiv(req.num_computed_tokens + 1 + len(drafts), kv.block_size) - len(
            kv.block_table(req.request_id))
        if need > 0 and kv.num_free_blocks < need + num_behind:
            return _NO_DRAFTS
        if kv.allocate_slots(req, 1 + len(drafts)) is None:
            return _NO_DRAFTS
        return drafts

    def _schedule_swapped(self, st: StepState) -> None:
        """2) Swapped requests come back, best first while they fit, before any new request is
        admitted (and not in a step that preempted)."""
        if st.preempted:
            return
        self.swapped.sort(key=st.key)
        loras = self._running_loras()
        while self.swapped and st.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if not self._lora_fits(req, loras):
                break
            num_new = self._num_new_tokens(req, st.budget)
            if num_new == 0:
                break
            need = _cdiv(req.num_computed_tokens + num_new, self.kv.block_size)
            if self._never_fits(req.num_computed_tokens + num_new):
                self._finish_too_long(req)
                continue
            # NOTE: one block of headroom while others run, so the next decode does not swap it
            # straight back out; with nothing running the whole cache is its, or it never fits.
            headroom = 1 if self.running else 0
            if self.kv.num_free_blocks < need + headroom:
                break
            pairs = self.kv.swap_in(req)
            assert pairs is not None, "swap-in found fewer free blocks than counted"
            st.ops.extend(("swap_in", c, g) for c, g in pairs)
            allocated = self.kv.allocate_slots(req, num_new)
            assert allocated is not None, "swap-in reserved too few blocks"
            self._drain_copies(st)
            self.swapped.pop(0)
            req.status = RequestStatus.RUNNING
            self._join(self.running, req)
            if req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)
            st.stats.num_swapped_in += 1
            self._schedule_tokens(req, num_new, st)

    def _schedule_waiting(self, st: StepState) -> None:
        """3) New (or recompute-preempted) requests, in policy order.

        NOTE: the loop re-checks self.swapped: a priority preemption may swap requests out
        partway through, and those must come back before anything else new is admitted."""
        if st.preempted or self.swapped:
            return
        if self._waiting_unsorted or not self.policy.static:
            self.waiting.sort(key=st.key)
            self._waiting_unsorted = False
        idx = 0
        loras = self._running_loras()
        while idx < len(self.waiting) and st.budget > 0 and not self.swapped:
            req = self.waiting[idx]
            if req.last_preempted_step == self.step_id:
                idx += 1          # NOTE: never re-admit a request in the step that evicted it
                continue
            if not self._lora_fits(req, loras):
                # NOTE: vLLM's rule: a request whose adapter would exceed --max-loras waits
                # without blocking those behind it, so requests for the adapters already
                # running keep being admitted (none of them is starved by it)
                idx += 1
                continue
            if self._never_fits(req.num_tokens):
                self._finish_too_long(req)
                continue
            if self.handoff is not None and self.handoff.wants(req):
                started = self.handoff.start(req, st.now)
                if started is None:
                    break         # no blocks for its remote prompt now, as _admit failing
                if started:
                    self.waiting.pop(idx)    # NOTE: vLLM's WAITING_FOR_REMOTE_KVS, off the queue
                    continue
            if self._awaiting_remote_kv(req, st.stats):
                idx += 1          # NOTE: vLLM's WAITING_FOR_REMOTE_KVS: skipped, not blocking
                continue
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                if not req.grammar.ready or req.grammar.error is not None:
                    idx += 1      # NOTE: vLLM's WAITING_FOR_FSM; the engine fails a broken one
                    continue
                req.status = RequestStatus.WAITING
            if not self._admit(req, st):
                break
            self.waiting.pop(idx)
            if req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)

    def _running_loras(self) -> set[int]:
        """The adapters of the running requests (each step runs every one of them)."""
        if not self.config.enable_lora:
            return set()
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether `req` may join `loras` (the running adapters) under --max-loras."""
        lora = req.lora_request
        return (lora is None or not self.config.enable_lora or lora.lora_int_id in loras
                or len(loras) < self.config.max_loras)

    def _admit(self, req: Request, st: StepState) -> bool:
        """Seat a waiting request and give it blocks (prefix hits, remote KV, new slots);
        False when it cannot start now, which ends the waiting phase."""
        seated = len(self.running) < self.config.max_num_seqs
        if not seated and not self.policy.preempts_for_waiting:
            return False
        hits, num_hit = self.kv.get_computed_blocks(req)
        remote = self._remote_blocks(req, num_hit)
        num_remote = len(remote) * self.kv.block_size
        num_new = req.num_tokens - num_hit - num_remote
        if num_new > st.budget:
            if not self.chunked:
                return False
            num_new = st.budget
        # NOTE: a waiting request has computed nothing; the prefix hits are counted by
        # allocate_slots and committed only once it succeeds. Remote blocks need slots like
        # computed tokens but cost no budget: their KV is loaded.
        num_slots = num_remote + num_new
        need = _cdiv(num_hit + num_slots, self.kv.block_size) - len(hits)
        if not seated:
            # NOTE: priority policy, all max_num_seqs seats taken: like vLLM, evict a
            # lower-priority running request for the seat (and the blocks it needs).
            self._preempt_for(req, need, st, need_seat=True)
            if len(self.running) >= self.config.max_num_seqs:
                return False
        allocated = self.kv.allocate_slots(req, num_slots, hits, num_hit)
        if allocated is None and self.policy.preempts_for_waiting:
            self._preempt_for(req, need, st)
            allocated = self.kv.allocate_slots(req, num_slots, hits, num_hit)
        if allocated is None:
            return False
        self._drain_copies(st)
        if self.kv_connector is not None:
            self.kv_connector.release(req.request_id)
        if remote:
            table = self.kv.get_block_ids(req.request_id)
            first = num_hit // self.kv.block_size
            for i, data in enumerate(remote):
                st.ops.append(("load", len(st.loads), table[first + i]))
                st.loads.append(data)
            st.stats.external_hit_tokens += num_remote
        req.num_computed_tokens = num_hit + num_remote
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = st.now
        req.status = RequestStatus.RUNNING
        self._join(self.running, req)
        self._schedule_tokens(req, num_new, st)
        return True

    def _preempt(self, victim: Request, st: StepState) -> None:
        """Evict a running request (vLLM's _preempt_request): the preemptor swaps out or frees
        its blocks, and it joins the swapped queue or, to be computed again, the waiting one."""
        self.running.remove(victim)
        if self.preemptor.evict(victim, st, self.config.preemption_mode) == RequestStatus.SWAPPED:
            self.swapped.append(victim)
        else:
            self._join(self.waiting, victim)

    def _preempt_for(self, req: Request, need: int, st: StepState, need_seat: bool = False) -> None:
        """Priority policy: evict strictly lower-priority running requests, worst first, but
        only if together they can make room (`need` more blocks, and a max_num_seqs seat when
        need_seat). Their scheduled tokens go back to the step's budget."""
        victims = [r for r in reversed(self.running) if r.priority > req.priority]
        held = sum(len(self.kv.get_block_ids(v.request_id)) for v in victims)
        if not victims or self.kv.num_free_blocks + held < need:
            return
        for victim in victims:
            sr = st.scheduled.pop(victim.request_id, None)
            if sr is not None:
                st.budget += sr.num_tokens
                _count_scheduled(st.stats, sr, -1)
            self._preempt(victim, st)
            seated = not need_seat or len(self.running) < self.config.max_num_seqs
            if seated and self.kv.num_free_blocks >= need:
                break

    def _commit(self, st: StepState) -> None:
        """The scheduled tokens will be computed by this step's forward pass. With async
        scheduling a request that samples counts its coming token as known at once (a
        placeholder): the next step schedules it before the host has it."""
        for sr in st.scheduled.values():
            sr.request.num_computed_tokens = sr.start + sr.num_tokens
        if self.async_scheduling:
            for sr in st.scheduled.values():
                if _makes_placeholder(sr):
                    sr.request.num_output_placeholders += 1
        self._fill_stats(st.stats)

    def _never_fits(self, num_tokens: int) -> bool:
        """True when even an empty GPU cache cannot hold num_tokens tokens' KV."""
        return _cdiv(num_tokens, self.kv.block_size) > self.kv.num_gpu_blocks

    def _finish_too_long(self, req: Request) -> None:
        """NOTE: a request that outgrew the whole cache (only if max_model_len exceeds it) ends
        as "length", like vLLM's FINISHED_IGNORED, instead of blocking every admission."""
        for child in self.pending_forks.pop(req.request_id, []):
            self._finish(child, RequestStatus.FINISHED_LENGTH)
        self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _prefetch_remote(self, req: Request) -> None:
        """Ask the connector to fetch a new request's full prompt blocks in the background.

        NOTE: the step never waits for the network: admission takes whatever has arrived by
        then (_remote_blocks) and computes the rest locally."""
        if self.kv_connector is None or req.skip_prefix_cache:
            return
        limit = (req.num_tokens - 1) // self.kv.block_size   # one token is always computed
        if limit <= 0:
            return
        self.kv_connector.prefetch(req.request_id, req.block_hashes[:limit])

    def _awaiting_remote_kv(self, req: Request, stats: SchedulerStats) -> bool:
        """True while the request's prefetch is still in flight and it has waited less than
        REMOTE_KV_WAIT_S: admitted now it would compute what another pod already stored.
        Counts each request's wait once (stats.remote_kv_waits) and a wait that ran out
        (remote_kv_timeouts).

        NOTE: only this request waits; the step and every other request go on. The bound
        keeps a slow (or hung) store from delaying it by more than that."""
        c = self.kv_connector
        if c is None:
            return False
        rid = req.request_id
        if not c.ready(rid):
            if self.clock() - req.arrival_time < REMOTE_KV_WAIT_S:
                if rid not in self._awaiting_kv:
                    self._awaiting_kv.add(rid)
                    stats.remote_kv_waits += 1
                return True
            if rid in self._awaiting_kv:
                stats.remote_kv_timeouts += 1
        self._awaiting_kv.discard(rid)
        return False

    def _remote_blocks(self, req: Request, num_hit: int) -> list[bytes]:
        """KV bytes of the full blocks after the local prefix hits that another pod stored
        and the prefetch already brought in (never waits)."""
        if self.kv_connector is None or req.skip_prefix_cache:
            return []
        bs = self.kv.block_size
        limit = (req.num_tokens - 1) // bs          # at least one token is left to compute
        if num_hit // bs >= limit:
            return []
        return self.kv_connector.lookup(req.request_id, req.block_hashes[num_hit // bs:limit])

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        # NOTE: called for every running request every step: len() and a comparison rather
        # than the num_tokens property and max() (benchmarks/scheduler_step.py)
        num_new = len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens
        if req.num_output_placeholders and (
                len(req.output_token_ids) + req.num_output_placeholders >= req.max_tokens):
            return 0      # NOTE: its token in flight is its last (length): nothing to schedule
        if num_new > budget:
            # NOTE: with chunked prefill off a prefill waits for a step with room for all of it.
            return budget if self.chunked else 0
        return num_new if num_new > 0 else 0

    def _join(self, queue: list[Request], req: Request) -> None:
        """Append to the running or waiting queue; the next step sorts it again (with a static
        policy only then: removals keep a queue's order)."""
        queue.append(req)
        if queue is self.running:
            self._running_unsorted = True
        else:
            self._waiting_unsorted = True

    def _schedule_tokens(self, req: Request, num_new: int, st: StepState,
                         drafts: Sequence[int] = _NO_DRAFTS) -> None:
        """`num_new` tokens of `req` in this step, its `drafts` (speculative decoding) last."""
        rid = req.request_id
        start = req.num_computed_tokens
        sample = start + num_new - len(drafts) == len(req.all_token_ids) + req.num_output_placeholders
        children: tuple[Request, ...] = ()
        if sample and self.pending_forks and not req.output_token_ids and rid in self.pending_forks:
            children = tuple(self.pending_forks[rid])
        # NOTE: the live table, not a copy: the runner reads it within this step only.
        table = self.kv.block_table(rid)
        sr = self._records.get(rid)
        if sr is None:
            sr = self._records[rid] = ScheduledRequest(req, start, num_new, table, sample, children,
                                                       drafts)
        else:
            sr.start, sr.num_tokens, sr.block_ids = start, num_new, table
            sr.sample, sr.fork_children, sr.spec_token_ids = sample, children, drafts
        _count_scheduled(st.stats, sr, +1)
        st.scheduled[rid] = sr
        st.budget -= num_new

    def _drain_copies(self, st: StepState) -> None:
        copies = self.kv.take_copies()
        if copies:            # rare (copy-on-write after a fork): keep the common path cheap
            st.ops.extend(("copy", src, dst) for src, dst in copies)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """The step's results into the requests (vLLM's update_from_output): prompt log-probs
        are recorded, finished embeddings requests finish, sampled tokens are appended (n > 1
        samples fork), each constrained sample's grammar accepts its token, and the prefill
        rate is refined. The output stage then checks the stops and finishes requests
        (finish_request), and end_step closes the step's stats.

        Returns the requests that got a new token, in step order.
        """
        if result.prompt_logprobs:
            self._record_prompt_logprobs(result.prompt_logprobs)
        if result.pooled:
            self._finish_pooled(result.pooled)
        now = self.clock()
        touched: list[Request] = []
        num_verified: dict[str, int] = {}      # speculating requests: tokens appended
        sampled, all_logprobs = result.sampled, result.logprobs
        placeholders = self.async_scheduling
        for sr in out.scheduled:
            req = sr.request
            if placeholders and _makes_placeholder(sr):
                req.num_output_placeholders -= 1      # its token is here (or discarded)
            if not sr.sample or req.status in _FINISHED:
                continue
            rid = req.request_id
            if sr.spec_token_ids:
                num_verified[rid] = self._append_verified(sr, result, out.stats, now)
                touched.append(req)
                continue
            tokens = sampled[rid]
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            if sr.fork_children:
                self._start_forks(sr, tokens, logprobs, now, touched)
            self._append(req, tokens[0], logprobs[0] if logprobs else None, now)
            touched.append(req)
        if self.structured is not None:
            for req in self.structured.accept(touched, num_verified):
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self.preemptor.learn_prefill_rate(out.stats.num_scheduled_tokens, result.model_time_s)
        return touched

    def _record_prompt_logprobs(
            self, chunks: dict[str, tuple[int, list[dict[int, Logprob]]]]) -> None:
        for rid, (first, entries) in chunks.items():
            req = self.requests.get(rid)
            if req is not None:
                record_prompt_logprobs(req, first, entries)

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> None:
        """Embeddings requests end with their prefill (nothing is sampled): finished now, their
        blocks freed; the output stage builds their outputs from `pooled`."""
        for rid in pooled:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def _start_forks(self, sr: ScheduledRequest, tokens: list[int],
                     logprobs: list[dict[int, Logprob]] | None, now: float,
                     touched: list[Request]) -> None:
        """n > 1: samples 1.. of a prompt just prefilled share its blocks and get their tokens."""
        req = sr.request
        for k, child in enumerate(sr.fork_children, start=1):
            if child.status != RequestStatus.WAITING_FOR_FORK:
                continue
            self.kv.fork(req, child)
            child.num_computed_tokens = req.num_computed_tokens
            child.num_cached_tokens = req.num_cached_tokens
            child.first_scheduled_time = req.first_scheduled_time
            child.status = RequestStatus.RUNNING
            self._join(self.running, child)
            self._append(child, tokens[k], logprobs[k] if logprobs else None, now)
            touched.append(child)
        self.pending_forks.pop(req.request_id, None)

    def _append_verified(self, sr: ScheduledRequest, result: ModelRunnerOutput,
                         stats: SchedulerStats, now: float) -> int:
        """Speculative decoding: the accepted drafts and the token after them join the request;
        the rejected drafts' positions are no longer computed (their KV slots stay in the
        table and are overwritten by the tokens that come next; blocks are hashed from the
        appended tokens only, so a rejected draft never reaches the prefix cache)."""
        req, rid = sr.request, sr.request.request_id
        tokens = result.spec_tokens[rid]
        logprobs = result.spec_logprobs.get(rid)
        num_accepted = len(tokens) - 1
        req.num_computed_tokens -= len(sr.spec_token_ids) - num_accepted
        for i, token in enumerate(tokens):
            self._append(req, token, logprobs[i] if logprobs else None, now)
        self.speculator.record(rid, len(sr.spec_token_ids), num_accepted, stats)
        return len(tokens)

    def end_step(self, out: SchedulerOutput) -> None:
        """Count the block operations since schedule() (a finished request frees its blocks)
        in this step's stats."""
        self._add_block_counters(out.stats)

    def _append(self, req: Request, token: int, logprobs: dict[int, Logprob] | None,
                now: float) -> None:
        req.append_output_token(token)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = now

    # ---- stats ---------------------------------------------------------------------------
    def _kv_counters(self) -> tuple[int, ...]:
        s = self.kv.stats
        return tuple(getattr(s, name) for name in _KV_COUNTERS)

    def _counters_since_mark(self) -> dict[str, int]:
        now = self._kv_counters()
        delta = dict(zip(_KV_COUNTERS, (a - b for a, b in zip(now, self._kv_mark))))
        self._kv_mark = now
        return delta

    def _add_block_counters(self, stats: SchedulerStats) -> None:
        """Add the block operations since the last mark to this step's stats."""
        delta = self._counters_since_mark()
        stats.blocks_allocated += delta["blocks_allocated"]
        stats.blocks_freed += delta["blocks_freed"]
        stats.blocks_evicted += delta["blocks_evicted"]
        stats.cow_copies += delta["cow_copies"]
        stats.prefix_query_tokens += delta["prefix_queries"]
        stats.prefix_hit_tokens += delta["prefix_hits"]

    def _fill_stats(self, stats: SchedulerStats) -> None:
        self._add_block_counters(stats)
        stats.kv_usage = self.kv.usage
        stats.num_running = len(self.running)
        stats.num_waiting = (len(self.waiting) + sum(len(c) for c in self.pending_forks.values())
                             + (len(self.handoff.loading) if self.handoff is not None else 0))
        stats.num_swapped = len(self.swapped)

