"""The engine's step timers on /metrics: kvmesh:engine_step_seconds_total (schedule to outputs
built) and kvmesh:engine_forward_seconds_total (the forward and sampler), summed over steps.
benchmarks/serve_gap.py reads them beside the client's inter-token latency."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from kvmesh.api.metrics import EngineMetrics
from kvmesh.engine.observers import LoadSnapshot, StepReport
from kvmesh.engine.sched_output import SchedulerStats


def _report(step: int, t_start: float, t_scheduled: float, t_executed: float,
            t_end: float) -> StepReport:
    return StepReport(step, t_start, t_scheduled, t_executed, t_end, None,
                      SimpleNamespace(stats=SchedulerStats()), [], None, LoadSnapshot(0, 0, 0, 0))


def test_step_and_forward_seconds_sum_the_reports_times():
    m = EngineMetrics("m")
    m.on_step(_report(1, 10.0, 10.25, 11.0, 11.5))     # step 1.5 s, forward 0.75 s
    m.on_step(_report(2, 12.0, 12.125, 12.5, 12.625))  # step 0.625 s, forward 0.375 s
    assert m.extra["kvmesh:engine_steps"] == 2
    assert m.extra["kvmesh:engine_step_seconds"] == 2.125
    assert m.extra["kvmesh:engine_forward_seconds"] == 1.125
    text = generate_latest(m.registry).decode()
    assert 'kvmesh:engine_step_seconds_total{model_name="m"} 2.125' in text
    assert 'kvmesh:engine_forward_seconds_total{model_name="m"} 1.125' in text
    assert 'kvmesh:engine_steps_total{model_name="m"} 2.0' in text
