"""Preemption: how a running request gives way, by recompute or by swap.

The scheduler decides *who* gives way (the worst running request when blocks run out; under
`priority`, lower-priority ones for a waiting request) and moves it between its queues, in
`Scheduler._preempt` beside `schedule()`, as vLLM's `_preempt_request`. The `Preemptor` it owns
decides *how* and does the request's side: swap its blocks out or free them, record the block
moves and the counts in the step's state, mark the request.

NOTE: a collaborator, not folded back into the scheduler: the "how" keeps state no queue needs
(the bytes of a block, the swap bandwidth and the prefill rate measured step by step that `auto`
compares) and needs none of the queues. Its interface is the victim, the step's `StepState` and
the preemption mode (read from the scheduler's config at each preemption), nothing read from
the scheduler behind its back.
"""
from __future__ import annotations

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.step_state import StepState


class Preemptor:
    def __init__(
        self,
        kv: KVCacheManager,
        block_bytes: int,               # bytes of one block across all layers (K and V)
        recompute_tokens_per_s: float,  # prefill rate, refined from measured steps
        swap_bytes_per_s: float,        # host <-> device copy bandwidth
    ) -> None:
        self.kv = kv
        self.block_bytes = block_bytes
        self.recompute_tokens_per_s = recompute_tokens_per_s
        self.swap_bytes_per_s = swap_bytes_per_s

    def evict(self, victim: Request, st: StepState, mode: str) -> RequestStatus:
        """Take a running request's blocks: swapped out to the CPU (block moves recorded in `st`)
        or freed (its tokens are computed again), as `mode` (--preemption-mode: "recompute",
        "swap" or "auto") says. Returns its new status, SWAPPED or WAITING: the queue it belongs
        in."""
        stats = st.stats
        if self._choose_swap(victim, mode):
            st.ops.extend(("swap_out", g, c) for g, c in self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            stats.num_preempted_swap += 1
            stats.num_swapped_out += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            stats.num_preempted_recompute += 1
        victim.num_preemptions += 1
        victim.last_preempted_step = st.step
        stats.num_preempted += 1
        st.preempted.append(victim)
        return victim.status

    def learn_prefill_rate(self, tokens: int, seconds: float) -> None:
        """Refine the prefill rate from one step's forward pass (tokens computed, seconds)."""
        if tokens >= 64 and seconds > 0:
            rate = tokens / seconds
            self.recompute_tokens_per_s = 0.8 * self.recompute_tokens_per_s + 0.2 * rate

    def _choose_swap(self, req: Request, mode: str) -> bool:
        if mode == "recompute" or req.num_computed_tokens == 0 or not self.kv.can_swap_out(req):
            return False
        if mode == "swap":
            return True
        num_blocks = len(self.kv.get_block_ids(req.request_id))
        swap_cost = 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s
        recompute_cost = req.num_computed_tokens / self.recompute_tokens_per_s
        return swap_cost < recompute_cost
