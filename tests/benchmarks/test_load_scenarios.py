"""Pure parts of the load-scenario benchmark: no server, no network, a fake clock."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from benchmarks.load_stats import (RequestResult, build_summary, cap_requests, format_runs,
                                   format_table, percentile, priority_for, replay, send_offsets,
                                   tpot)
from benchmarks.workload import WorkloadRequest, generate_requests


def _result(policy="fcfs", cls=0, ttft=0.5, e2e=2.5, tokens=5, error=None, scenario="low", index=0):
    return RequestResult(scenario, policy, index, 1, cls, priority_for(cls), 10, tokens, 0.0, 0.0,
                         None if error else ttft, None if error else e2e,
                         0 if error else tokens, error)


# ---------------------------------------------------------------------------- percentiles / TPOT


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edge_cases():
    assert percentile([], 50) is None
    assert percentile([None, None], 90) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([None, 1.0, 3.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_is_standard_definition():
    # 5 tokens: the first at TTFT, four more over the remaining 2 s -> 0.5 s per token
    assert tpot(0.5, 2.5, 5) == pytest.approx(0.5)
    assert tpot(0.5, 2.5, 1) is None           # a single token has no inter-token time
    assert tpot(None, 2.5, 5) is None          # failure
    assert _result().tpot_s == pytest.approx(0.5)


# ---------------------------------------------------------------------------- priority rule


def test_priority_shorter_class_is_served_first():
    assert [priority_for(c) for c in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        priority_for(-1)


# ---------------------------------------------------------------------------- schedule / replay


def test_cap_keeps_first_arrivals_and_send_offsets_scale_time():
    reqs = [WorkloadRequest(t, 1, 0, 1, 1) for t in (4.0, 1.0, 2.0, 8.0)]
    capped = cap_requests(reqs, 3)
    assert [r.arrival_s for r in capped] == [1.0, 2.0, 4.0]
    assert send_offsets(capped, 2.0) == [0.5, 1.0, 2.0]
    assert len(cap_requests(reqs, None)) == 4
    with pytest.raises(ValueError):
        send_offsets(capped, 0)
    with pytest.raises(ValueError):
        cap_requests(reqs, 0)


def test_capped_scenario_is_a_prefix_of_the_full_one():
    full = generate_requests("high", seed=0, scale=20, max_total_len=256)
    assert cap_requests(full, 10) == full[:10]


class FakeClock:
    def __init__(self, start=100.0):
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_replay_sends_each_request_at_its_offset():
    clock = FakeClock()
    sent: list[tuple[int, float]] = []

    async def send(i, t0):
        sent.append((i, clock() - t0))

    t0 = asyncio.run(replay([0.0, 1.5, 0.5, 1.5], send, clock, clock.sleep))
    assert t0 == 100.0
    assert sent == [(0, 0.0), (2, 0.5), (1, 1.5), (3, 1.5)]  # arrival order, ties kept
    assert clock.sleeps == [0.5, 1.0]                         # no sleep for due requests


def test_replay_late_loop_sends_at_once_and_waits_for_all():
    clock = FakeClock()
    done: list[int] = []

    async def send(i, t0):
        clock.now += 2.0          # each send makes the loop 2 s late (a slow request start)
        await asyncio.sleep(0)
        done.append(i)

    asyncio.run(replay([0.0, 1.0, 3.0], send, clock, clock.sleep))
    assert sorted(done) == [0, 1, 2]        # none skipped
    assert clock.sleeps == []               # always late -> never slept


# ---------------------------------------------------------------------------- summary table


def test_build_summary_groups_by_run_and_class():
    rs = [_result("fcfs", 0, ttft=0.1, e2e=1.1, tokens=11, index=0),
          _result("fcfs", 0, ttft=0.3, e2e=2.3, tokens=11, index=1),
          _result("fcfs", 3, ttft=2.0, e2e=12.0, tokens=21, index=2),
          _result("fcfs", 3, error="HTTP 500", index=3),
          _result("sjf", 0, ttft=0.2, e2e=1.2, tokens=11, index=0)]
    walls = {("low", "fcfs"): 10.0, ("low", "sjf"): 5.0}
    rows = build_summary(rs, walls)
    keys = [(r.policy, r.length_class) for r in rows]
    assert keys == [("fcfs", "short"), ("fcfs", "very_long"), ("fcfs", "all"),
                    ("sjf", "short"), ("sjf", "all")]
    short, vlong, total = rows[0], rows[1], rows[2]
    assert (short.count, short.failed) == (2, 0)
    assert short.ttft[0] == pytest.approx(0.2)                    # p50 of 0.1, 0.3
    assert short.tpot[0] == pytest.approx(0.15)                   # p50 of 1.0 / 10, 2.0 / 10
    assert short.throughput_tps == pytest.approx(22 / 10.0)
    assert (vlong.count, vlong.failed) == (1, 1)
    assert vlong.e2e == (12.0, 12.0, 12.0)
    assert total.count == 3 and total.failed == 1
    assert total.throughput_tps == pytest.approx(short.throughput_tps + vlong.throughput_tps)
    assert short.seed_tps == pytest.approx((11 / 1.1 + 11 / 2.3) / 2)   # the seed's "TPOT"
    assert rows[4].throughput_tps == pytest.approx(11 / 5.0)


def test_format_table_has_one_line_per_row_and_dashes_for_missing():
    rows = build_summary([_result(error="boom")], {("low", "fcfs"): 1.0})
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| scenario | policy | class | n | fail | TTFT s")
    assert len(lines) == 2 + len(rows)
    assert "| low | fcfs | short | 0 | 1 | - / - / - |" in text
    assert "**all**" in lines[-1]


def test_format_table_units():
    rows = build_summary([_result(ttft=0.25, e2e=0.65, tokens=5)], {("low", "fcfs"): 2.0})
    line = format_table(rows).splitlines()[2]
    assert "| 0.25 / 0.25 / 0.25 |" in line     # TTFT in seconds
    assert "| 100 / 100 / 100 |" in line        # TPOT in ms: 0.4 s / 4
    assert "| 2.5 |" in line                    # 5 tokens / 2 s


def test_format_runs():
    text = format_runs([{"scenario": "high", "policy": "sjf", "requests": 8, "wall_s": 13.87,
                         "preemptions": 4.0, "max_lateness_s": 0.014},
                        {"scenario": "low", "policy": "sjf", "requests": 8, "wall_s": 4.9,
                         "preemptions": None, "max_lateness_s": 0.0}])
    assert text.splitlines()[2] == "| high | sjf | 8 | 13.9 | 4 | 0.01 |"
    assert text.splitlines()[3] == "| low | sjf | 8 | 4.9 | - | 0.00 |"
