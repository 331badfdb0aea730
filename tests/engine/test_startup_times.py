"""Start-up phase seconds (issue 27): what `startup_phase(phase=...)` records, nested phases counted
once, the process age read from /proc, and `kvmesh:startup_phase_seconds{phase}` on /metrics.
Time comes from a fake clock: exact values, nothing timed."""
from __future__ import annotations

import io
import os
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.metrics import EngineMetrics
from kvmesh.common.startup import startup_phase
from kvmesh.common.startup_times import (PHASES, StartupTimes, age_from_stat, get_startup_times,
                                         process_age_s, reset_startup_times)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def times() -> StartupTimes:
    yield reset_startup_times()
    reset_startup_times()


def _phase(name: str, phase: str | None, clock: FakeClock):
    return startup_phase(name, stream=io.StringIO(), phase=phase, clock=clock)


def test_each_phase_adds_its_duration_and_a_nested_phase_is_taken_off_its_parent(times):
    clock = FakeClock()
    with _phase("fetching model", "fetch", clock):
        clock.now += 4.0
    with _phase("allocating the KV cache", "kv_alloc", clock):
        clock.now += 1.5
        with _phase("capturing CUDA graphs", "kernel_build", clock):
            clock.now += 2.25
        clock.now += 0.5
    with _phase("loading weights", "weight_load", clock):      # a draft model: a second load
        clock.now += 3.0
    with _phase("loading weights", "weight_load", clock):
        clock.now += 1.0
    with _phase("unrecorded", None, clock):
        clock.now += 50.0
    assert times.seconds == {"fetch": 4.0, "kernel_build": 2.25, "weight_load": 4.0,
                             "kv_alloc": 2.0, "warmup": 0.0}
    assert times is get_startup_times()
    assert times.summary() == ("fetch 4.0 s, kernel_build 2.2 s, weight_load 4.0 s, "
                               "kv_alloc 2.0 s, warmup 0.0 s")
    times.total_s = 13.75
    assert times.series()[-1] == ("total", 13.75)
    assert times.summary().endswith("warmup 0.0 s, total 13.8 s")


def test_phases_on_two_threads_never_nest_into_each_other(times):
    clock = FakeClock()
    inner_open, outer_may_end = threading.Event(), threading.Event()

    def other_thread():
        with _phase("loading weights", "weight_load", clock):
            inner_open.set()
            outer_may_end.wait(10)
            clock.now += 1.0                  # the weights' second second

    with _phase("allocating the KV cache", "kv_alloc", clock):
        t = threading.Thread(target=other_thread)
        t.start()
        inner_open.wait(10)
        clock.now += 1.0
        outer_may_end.set()
        t.join(10)
    # both phases ran 2 s; neither is taken off the other
    assert (times.seconds["kv_alloc"], times.seconds["weight_load"]) == (2.0, 2.0)
    assert times._open == {}


def test_a_failed_phase_still_counts_its_time_and_the_log_says_how_long(times, caplog):
    caplog.set_level("INFO", logger="kvmesh.startup")
    clock = FakeClock()
    with pytest.raises(RuntimeError), _phase("warm-up", "warmup", clock):
        clock.now += 7.0
        raise RuntimeError("boom")
    assert times.seconds["warmup"] == 7.0
    assert caplog.messages[-1] == "warm-up: failed after 7.0 s"


def test_an_unknown_phase_is_refused_by_name(times):
    with pytest.raises(ValueError, match="unknown start-up phase 'compile'; one of fetch, "
                       "kernel_build, weight_load, kv_alloc, warmup"):
        with _phase("x", "compile", FakeClock()):
            pass


def test_process_age_from_a_stat_line_whose_command_name_holds_spaces_and_parentheses():
    # fields 3.. of a real line; starttime (field 22) = 12_345 ticks after boot
    rest = "S 1 2 3 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 1 0 12345 1000 200"
    stat = f"4242 (python (x) y) {rest}"
    assert age_from_stat(stat, boottime_s=223.45, ticks_per_s=100) == pytest.approx(100.0)
    # this process: started before now, and not a day ago
    assert 0.0 < process_age_s() < 86_400.0


def test_process_age_matches_this_process_start_as_the_kernel_reports_it():
    with open(f"/proc/{os.getpid()}/stat") as f:
        stat = f.read()
    age = age_from_stat(stat, time.clock_gettime(time.CLOCK_BOOTTIME), os.sysconf("SC_CLK_TCK"))
    assert abs(process_age_s() - age) < 0.1


def test_metrics_export_every_phase_and_the_total_once_ready():
    times = StartupTimes()
    times.seconds.update(fetch=2.5, kernel_build=0.25, weight_load=1.75, kv_alloc=0.5, warmup=0.125)
    metrics = EngineMetrics("m", startup=times)

    def series() -> dict[str, float]:
        fams = [f for f in text_string_to_metric_families(metrics.render().decode())
                if f.name == "kvmesh:startup_phase_seconds"]
        assert len(fams) == 1 and fams[0].type == "gauge"
        assert all(s.labels["model_name"] == "m" for s in fams[0].samples)
        return {s.labels["phase"]: s.value for s in fams[0].samples}

    assert series() == {"fetch": 2.5, "kernel_build": 0.25, "weight_load": 1.75, "kv_alloc": 0.5,
                        "warmup": 0.125}
    times.total_s = 9.0
    assert series() == {"fetch": 2.5, "kernel_build": 0.25, "weight_load": 1.75, "kv_alloc": 0.5,
                        "warmup": 0.125, "total": 9.0}
    assert list(series()) == [*PHASES, "total"]
    # vLLM has no such metric: no vllm: twin
    assert b"vllm:startup_phase_seconds" not in metrics.render()
    assert b"startup_phase_seconds" not in EngineMetrics("m").render()
