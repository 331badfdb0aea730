"""Each tool's report, as the tool really wrote it (tests/benchmarks/fixtures/serving/README.md
says how they were recorded), read into the common rows."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from benchmarks.serving_reports import (Percentiles, ReportError, parse_guidellm,
                                        parse_inference_perf, parse_vllm_bench)

FIX = Path(__file__).resolve().parent / "fixtures" / "serving"


def _gunzip(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name.replace("/", "-").removesuffix(".gz")
    out.write_bytes(gzip.decompress((FIX / name).read_bytes()))
    return out


def _nan(p: Percentiles) -> bool:
    return all(math.isnan(x) for x in (p.p50, p.p90, p.p99))


def test_guidellm_one_row_per_benchmark(tmp_path):
    rows = parse_guidellm(_gunzip("guidellm.json.gz", tmp_path), "kvmesh", "fixed")
    assert [(r.system, r.tool, r.workload, r.load, r.completed, r.failed) for r in rows] == [
        ("kvmesh", "guidellm", "fixed", "concurrency=1", 2, 0),
        ("kvmesh", "guidellm", "fixed", "concurrency=2", 2, 0)]
    first = rows[0]
    assert first.request_per_s == pytest.approx(1.3373828160995955)
    assert first.ttft_ms == Percentiles(145.74599266052246, 196.36058807373047, 196.36058807373047)
    assert first.itl_ms.p50 == pytest.approx(58.059624263218474)
    # request_latency is in seconds in guidellm's report
    assert first.e2e_ms.p90 == pytest.approx(939.5735263824463)
    # every request asked for exactly 8 output tokens
    for r in rows:
        assert r.output_tok_per_s == pytest.approx(8 * r.request_per_s, rel=1e-6)
        assert r.ttft_ms.p50 <= r.ttft_ms.p90 <= r.ttft_ms.p99 < r.e2e_ms.p99


def test_guidellm_nothing_succeeded(tmp_path):
    rows = parse_guidellm(_gunzip("failed/guidellm.json.gz", tmp_path), "kvmesh", "fixed")
    assert [(r.load, r.completed, r.failed, r.request_per_s) for r in rows] == [
        ("concurrency=1", 0, 2, 0.0), ("concurrency=2", 0, 2, 0.0)]
    assert all(_nan(r.ttft_ms) and _nan(r.itl_ms) and _nan(r.e2e_ms) for r in rows)


def test_inference_perf_one_row_per_stage():
    rows = parse_inference_perf(FIX / "inference-perf", "kvmesh", "varied")
    assert [(r.tool, r.load, r.completed, r.failed) for r in rows] == [
        ("inference-perf", "concurrency=1", 2, 0), ("inference-perf", "concurrency=2", 2, 0)]
    r = rows[1]
    assert r.request_per_s == pytest.approx(2.3349433398092505)
    assert r.output_tok_per_s == pytest.approx(17.51207504856938)
    # seconds in the report, milliseconds in the row
    assert r.ttft_ms == Percentiles(pytest.approx(130.26683249995585),
                                    pytest.approx(168.34466969980895),
                                    pytest.approx(176.9121830697759))
    assert r.itl_ms.p99 == pytest.approx(89.30724296011248)
    assert r.e2e_ms.p50 == pytest.approx(517.1375474999422)
    assert r.report.endswith("stage_1_lifecycle_metrics.json")


def test_inference_perf_load_label_can_be_given():
    rows = parse_inference_perf(FIX / "inference-perf", "kvmesh (fcfs)", "low", load="trace")
    assert [r.load for r in rows] == ["trace", "trace"]


def test_inference_perf_nothing_succeeded():
    [r] = parse_inference_perf(FIX / "failed" / "inference-perf", "kvmesh", "varied")
    assert (r.load, r.completed, r.failed, r.output_tok_per_s) == ("concurrency=1", 0, 2, 0.0)
    assert _nan(r.ttft_ms) and _nan(r.itl_ms) and _nan(r.e2e_ms)


def test_vllm_bench_concurrency_and_rate():
    [c] = parse_vllm_bench(FIX / "vllm-bench-concurrency-2.json", "kvmesh", "fixed")
    assert (c.tool, c.load, c.completed, c.failed) == ("vllm-bench", "concurrency=2", 2, 0)
    assert c.output_tok_per_s == pytest.approx(8 * c.request_per_s, rel=1e-6)
    assert c.ttft_ms == Percentiles(176.0115814997789, 225.41032989979612, 236.5250482898)
    assert c.itl_ms.p90 == pytest.approx(165.42624149983573)
    assert c.e2e_ms.p99 == pytest.approx(1088.6596753699405)
    [r] = parse_vllm_bench(FIX / "vllm-bench-rate-4.json", "vllm", "varied")
    assert (r.system, r.workload, r.load) == ("vllm", "varied", "rate=4")
    assert r.request_per_s == pytest.approx(2.1177496976807872)


def test_vllm_bench_nothing_succeeded():
    [r] = parse_vllm_bench(FIX / "failed" / "vllm-bench-rate-4.json", "kvmesh", "fixed")
    assert (r.completed, r.failed, r.request_per_s) == (0, 2, 0.0)
    assert _nan(r.ttft_ms) and _nan(r.e2e_ms)


# ---- bad reports --------------------------------------------------------------------------------
def test_not_json(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    with pytest.raises(ReportError, match="r.json: not a readable JSON report"):
        parse_vllm_bench(bad, "kvmesh", "fixed")


def test_missing_file(tmp_path):
    with pytest.raises(ReportError, match="absent.json: not a readable JSON report"):
        parse_guidellm(tmp_path / "absent.json", "kvmesh", "fixed")


def test_a_missing_key_is_named(tmp_path):
    raw = json.loads((FIX / "vllm-bench-concurrency-2.json").read_text())
    del raw["p90_itl_ms"]
    path = tmp_path / "v.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ReportError, match="v.json: the report has no 'p90_itl_ms'"):
        parse_vllm_bench(path, "kvmesh", "fixed")


def test_a_wrong_type_is_named(tmp_path):
    raw = json.loads((FIX / "vllm-bench-concurrency-2.json").read_text())
    raw["request_throughput"] = "fast"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ReportError, match="'request_throughput' is not a number"):
        parse_vllm_bench(path, "kvmesh", "fixed")


def test_guidellm_without_benchmarks(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(ReportError, match="no benchmarks"):
        parse_guidellm(path, "kvmesh", "fixed")


def test_inference_perf_directory_without_stage_reports(tmp_path):
    (tmp_path / "summary_lifecycle_metrics.json").write_text("{}")
    with pytest.raises(ReportError, match="no stage_<i>_lifecycle_metrics.json"):
        parse_inference_perf(tmp_path, "kvmesh", "fixed")


def test_guidellm_unknown_strategy(tmp_path):
    raw = json.loads(gzip.decompress((FIX / "guidellm.json.gz").read_bytes()))
    raw["benchmarks"][0]["config"]["strategy"]["type_"] = "sweep-of-its-own"
    path = tmp_path / "g.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ReportError, match="strategy 'sweep-of-its-own' is not a load point"):
        parse_guidellm(path, "kvmesh", "fixed")
