"""Preemption: which running request gives way, and how (recompute or swap).

A mixin of Scheduler (it moves requests between the scheduler's queues); kept apart so that
scheduler.py reads as the step's three phases.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.step_state import StepState

from kvmesh.engine.sched_output import ScheduledRequest, SchedulerStats

if TYPE_CHECKING:
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.kv_cache_manager import KVCacheManager


def count_scheduled(stats: SchedulerStats, sr: ScheduledRequest, sign: int) -> None:
    """Add (sign +1) or take back (-1, a victim's tokens) one scheduled request's counts."""
    if sr.is_decode:
        stats.num_decode_reqs += sign
    else:
        stats.num_prefill_reqs += sign
        if not sr.sample:
            stats.num_chunked_prefills += sign
    stats.num_scheduled_tokens += sign * sr.num_tokens


class Preemption:
    # the Scheduler's state this mixin reads and moves requests between
    config: EngineConfig
    kv: KVCacheManager
    running: list[Request]
    waiting: list[Request]
    swapped: list[Request]
    step_id: int
    block_bytes: int
    swap_bytes_per_s: float
    recompute_tokens_per_s: float
    _join: Callable[[list[Request], Request], None]   # queue append that marks it for sorting

    def _choose_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or req.num_computed_tokens == 0 or not self.kv.can_swap_out(req):
            return False
        if mode == "swap":
            return True
        num_blocks = len(self.kv.get_block_ids(req.request_id))
        swap_cost = 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s
        recompute_cost = req.num_computed_tokens / self.recompute_tokens_per_s
        return swap_cost < recompute_cost

    def _preempt(self, victim: Request, st: StepState) -> None:
        self.running.remove(victim)
        stats = st.stats
        if self._choose_swap(victim):
            st.ops.extend(("swap_out", g, c) for g, c in self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            stats.num_preempted_swap += 1
            stats.num_swapped_out += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self._join(self.waiting, victim)
            stats.num_preempted_recompute += 1
        victim.num_preemptions += 1
        victim.last_preempted_step = self.step_id
        stats.num_preempted += 1
        st.preempted.append(victim)

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
                count_scheduled(st.stats, sr, -1)
            self._preempt(victim, st)
            seated = not need_seat or len(self.running) < self.config.max_num_seqs
            if seated and self.kv.num_free_blocks >= need:
                break
