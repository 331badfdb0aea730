"""Engine observers: the one interface through which tracing, metrics and the prefix-index
publisher watch the engine.

    LLMEngine.add_request ──▶ observer.on_request_added(request_id, samples, trace_context)
    LLMEngine.abort_request ─▶ observer.on_request_aborted(request_id)
    LLMEngine.step ──────────▶ observer.on_step(StepReport)        once per step, after postprocess
    LLMEngine.reset_prefix_cache ─▶ observer.on_cache_reset(kv_events, load)
    AsyncLLMEngine.shutdown ─▶ observer.on_shutdown()

Every call runs on the engine's thread, between or at the end of steps: an observer must never
block (no network I/O; hand work to a thread of its own). The engine takes the step's KV events
once and gives the same batch to every observer, so no observer reaches into the KV manager, the
block pool or the scheduler's queues.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvmesh.common.kv_events import KVEventBatch
    from kvmesh.engine.outputs import RequestOutput
    from kvmesh.engine.request import Request
    from kvmesh.engine.sched_output import SchedulerOutput


@dataclass(slots=True, frozen=True)
class LoadSnapshot:
    """The engine's load as routers weigh it (heartbeats, metrics)."""
    running: int          # requests holding a seat in the running batch
    waiting: int          # requests queued for admission
    swapped: int          # requests preempted to the CPU swap space
    kv_usage: float       # fraction of KV-cache blocks in use, 0..1


@dataclass(slots=True)
class StepReport:
    """What one engine step did, handed to every observer after the step."""
    step: int                                   # the engine's step counter (1 for the first)
    t_start: float                              # monotonic s: the step began
    t_scheduled: float                          # monotonic s: Scheduler.schedule() returned
    t_executed: float                           # monotonic s: forward pass and sampling returned
    t_end: float                                # monotonic s: outputs built (stop checks done)
    sample_window: tuple[float, float] | None   # monotonic s: the sampler's start and end
    sched: SchedulerOutput                      # the step's decisions and SchedulerStats
    outputs: list[RequestOutput]                # what the step reports to clients
    kv_events: KVEventBatch | None              # block events of this step (None: none or off)
    load: LoadSnapshot                          # load after the step


class EngineObserver:
    """Base class with no-op hooks: override the ones you watch."""

    def on_request_added(self, request_id: str, samples: Sequence[Request],
                         trace_context: object | None) -> None:
        """A user request (its n samples) entered the scheduler."""

    def on_request_aborted(self, request_id: str) -> None:
        """A user request was aborted while unfinished."""

    def on_step(self, report: StepReport) -> None:
        """One step finished."""

    def on_cache_reset(self, kv_events: KVEventBatch | None, load: LoadSnapshot) -> None:
        """The prefix cache was reset between steps (its 'all cleared' event is in kv_events)."""

    def on_shutdown(self) -> None:
        """The engine thread stopped; release threads and connections."""
