"""StepState: the working state of one Scheduler.schedule() call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvmesh.engine.request import Request
from kvmesh.engine.sched_output import ScheduledRequest, SchedulerOutput, SchedulerStats


@dataclass(slots=True)
class StepState:
    """One schedule() call's working state, threaded through its three phases (running,
    swapped, waiting); output() is what the step hands to the runner."""
    step: int                              # the scheduler's step id
    now: float                             # the scheduler clock when the step began
    key: Callable[[Request], tuple]            # the policy's sort key at `now`
    budget: int                            # tokens left to schedule this step
    stats: SchedulerStats                  # this step's counters
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)   # in decision order
    preempted: list[Request] = field(default_factory=list)  # evicted this step, in order
    ops: list[tuple[str, int, int]] = field(default_factory=list)   # block moves, decision order
    loads: list[bytes] = field(default_factory=list)       # KV bytes of the "load" ops

    def output(self) -> SchedulerOutput:
        return SchedulerOutput(step=self.step, scheduled=list(self.scheduled.values()),
                               block_ops=self.ops, kv_loads=self.loads,
                               preempted_ids=[r.request_id for r in self.preempted],
                               stats=self.stats)
