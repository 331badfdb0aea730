"""benchmarks/serve_gap.py's pieces: the engine's timers read from /metrics, the request body
`vllm bench serve` sends, and the per-system environments."""
from __future__ import annotations

import pytest

from benchmarks.serve_gap import Point, System, parse_envs, read_timers, report, request_body

METRICS = """# HELP kvmesh:engine_steps engine steps
kvmesh:engine_steps_total{model_name="kvmesh"} 130.0
kvmesh:engine_step_seconds_total{model_name="kvmesh"} 2.5
kvmesh:engine_forward_seconds_total{model_name="kvmesh"} 2.25
kvmesh:engine_steps_created{model_name="kvmesh"} 1.7e+09
vllm:inter_token_latency_seconds_sum{model_name="kvmesh"} 3.5
vllm:inter_token_latency_seconds_count{model_name="kvmesh"} 100.0
"""


def test_read_timers_takes_the_counters_and_zero_for_a_missing_one():
    assert read_timers(METRICS) == {"kvmesh:engine_steps_total": 130.0,
                                    "kvmesh:engine_step_seconds_total": 2.5,
                                    "kvmesh:engine_forward_seconds_total": 2.25,
                                    "vllm:inter_token_latency_seconds_sum": 3.5,
                                    "vllm:inter_token_latency_seconds_count": 100.0}
    assert read_timers('kvmesh:engine_steps_total{model_name="m"} 3.0\n') == {
        "kvmesh:engine_steps_total": 3.0, "kvmesh:engine_step_seconds_total": 0.0,
        "kvmesh:engine_forward_seconds_total": 0.0,
        "vllm:inter_token_latency_seconds_sum": 0.0, "vllm:inter_token_latency_seconds_count": 0.0}


def test_the_body_is_vllm_bench_serves_with_no_temperature_unless_asked():
    body = request_body([5, 6], 64, None)
    assert body == {"model": "kvmesh", "prompt": [5, 6], "repetition_penalty": 1.0,
                    "max_tokens": 64, "logprobs": None, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert request_body([5], 8, 0.0)["temperature"] == 0.0


def test_envs_by_system_and_a_bad_one_refused():
    assert parse_envs(["spin:GOMP_SPINCOUNT=10000", "spin:OMP_WAIT_POLICY=ACTIVE"],
                      ["plain", "spin"]) == {
        "plain": {}, "spin": {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": "ACTIVE"}}
    for bad in ("other:A=1", "spin:A", "spin:=1"):
        with pytest.raises(ValueError, match="NAME:VAR=VALUE"):
            parse_envs([bad], ["plain", "spin"])


def test_report_gap_is_the_clients_itl_mean_minus_the_engines():
    s = System("new", "python")
    s.points[1] = Point(itls_ms=[30.0, 34.0, 32.0, 36.0], tokens=5, steps=4.0, step_s=0.12,
                        forward_s=0.1, engine_itl_s=0.096, engine_itls=3.0, cpu_s={"loop": 0.005, "engine": 0.1, "other": 0.05})
    row = report([s])[1].split()
    # tokens, ITL p50, p90, mean, step, forward, engine ITL, gap, CPU ms/token (loop, engine,
    # other);
    # p90 as statistics.quantiles' default (exclusive) method: 36 + 0.5 * (36 - 34)
    assert row[:2] == ["new", "1"]
    assert row[2:] == ["5", "33.00", "37.00", "33.00", "30.00", "25.00", "32.00", "1.00", "1.00",
                       "20.00", "10.00"]
