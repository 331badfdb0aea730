"""benchmarks/serving.py's command line: bad input ends with a clear message and exit status 2,
before anything long runs; the summary it writes from rows."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks.serving_reports import LoadPointRow, Percentiles
from benchmarks.serving_summary import format_table, plot, write_results

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


def _fake_tools(root: Path, monkeypatch) -> None:
    """Stand-in tool venvs (files only): these tests stop before any tool runs."""
    for env, rel in (("KVMESH_GUIDELLM_VENV", "g/bin/guidellm"),
                     ("KVMESH_INFERENCE_PERF_VENV", "ip/bin/inference-perf"),
                     ("KVMESH_VLLM_VENV", "v/bin/python")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
        monkeypatch.setenv(env, str(root / rel.split("/")[0]))


def test_a_missing_tool_is_a_cli_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_GUIDELLM_VENV", str(tmp_path / "nowhere"))
    code = serving.main(["run", "--tools", "guidellm", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"serving.py: error: guidellm: {tmp_path / 'nowhere' / 'bin' / 'guidellm'} "
                          "not found; install it with: ")


def test_vllm_without_its_venv_is_a_cli_error(tmp_path, monkeypatch, capsys):
    _fake_tools(tmp_path, monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    code = serving.main(["run", "--systems", "vllm", "--tools", "guidellm", "--model-dir",
                         str(model), "--vllm-venv", str(tmp_path / "no-vllm"),
                         "--out", str(tmp_path / "out")])
    assert code == 2
    assert f"vllm: {tmp_path / 'no-vllm' / 'bin' / 'python'} not found" in capsys.readouterr().err
    # what ran so far is still written
    meta = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]
    assert meta["errors"][0].startswith("vllm: ")


def test_a_server_that_does_not_start_is_a_cli_error(tmp_path, monkeypatch):
    """A real `kvmesh serve` on a model path that does not exist: it exits 2 at start-up."""
    _fake_tools(tmp_path, monkeypatch)
    done = subprocess.run([sys.executable, str(SCRIPT), "run", "--systems", "kvmesh", "--tools",
                           "guidellm", "--model-dir", str(tmp_path / "no-model"),
                           "--ready-timeout", "240", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "serving.py: error: kvmesh exited with status 2 before it was ready" in done.stderr
    assert f"model path does not exist: {tmp_path / 'no-model'}" in done.stderr


@pytest.mark.parametrize("argv,message", [
    (["run", "--concurrency", "0"], "values must be > 0"),
    (["run", "--systems", "kvmesh,sglang"], "unknown 'sglang'"),
    (["run", "--tools", "locust"], "unknown 'locust'"),
    (["run", "--spread", "1.5"], "--spread must be in [0, 1)"),
    (["run", "--prompt-tokens", "900", "--output-tokens", "200"], "exceeds --max-model-len"),
    (["run", "--num-requests", "0"], "--num-requests must be >= 1"),
    (["scenarios", "--scenarios", "extreme"], "unknown 'extreme'"),
    ([], "choose a command"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serving.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_scenarios_run_without_inference_perf_is_a_cli_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_INFERENCE_PERF_VENV", str(tmp_path / "nowhere"))
    assert serving.main(["scenarios", "--run", "--out", str(tmp_path)]) == 2
    assert "inference-perf: " in capsys.readouterr().err


def test_scenarios_writes_a_trace_and_a_config_each(tmp_path, capsys):
    code = serving.main(["scenarios", "--quick", "--scenarios", "low,high", "--tokenizer",
                         "/models/tok", "--url", "http://10.0.0.5:8000/", "--out", str(tmp_path)])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "inference_perf_high.yaml", "inference_perf_low.yaml", "trace_high.csv", "trace_low.csv"]
    text = (tmp_path / "inference_perf_low.yaml").read_text()
    assert "base_url: http://10.0.0.5:8000\n" in text and "type: trace_replay" in text
    assert capsys.readouterr().out.count("wrote ") == 4


def test_plan_builds_one_guidellm_and_inference_perf_run_per_workload_and_one_vllm_run_per_point(
        tmp_path):
    args = serving.parse_args(["run", "--workloads", "fixed,varied", "--concurrency", "1,4",
                               "--num-requests", "6"])
    from benchmarks.serving_tools import Target
    runs = serving.plan_tools("kvmesh", Target("http://h:1", "m", Path("/tok")), args,
                              {"guidellm": ["g"], "inference-perf": ["ip"],
                               "vllm-bench": ["vb"]}, tmp_path)
    assert [(r.tool, r.workload.name, r.report.relative_to(tmp_path).as_posix()) for r in runs] == [
        ("guidellm", "fixed", "kvmesh/guidellm/fixed/guidellm.json"),
        ("inference-perf", "fixed", "kvmesh/inference-perf/fixed/reports"),
        ("vllm-bench", "fixed", "kvmesh/vllm-bench/fixed/concurrency-1.json"),
        ("vllm-bench", "fixed", "kvmesh/vllm-bench/fixed/concurrency-4.json"),
        ("guidellm", "varied", "kvmesh/guidellm/varied/guidellm.json"),
        ("inference-perf", "varied", "kvmesh/inference-perf/varied/reports"),
        ("vllm-bench", "varied", "kvmesh/vllm-bench/varied/concurrency-1.json"),
        ("vllm-bench", "varied", "kvmesh/vllm-bench/varied/concurrency-4.json")]
    assert runs[4].workload.spread == 0.75 and runs[0].workload.spread == 0.0
    assert list(runs[1].files) == [str(tmp_path / "kvmesh/inference-perf/fixed/config.yaml")]


# ---- summary --------------------------------------------------------------------------------------
def _row(system, load, tok, ttft90, completed=4):
    return LoadPointRow(system, "guidellm", "fixed", load, completed, 4 - completed, tok / 8, tok,
                        Percentiles(ttft90 / 2, ttft90, ttft90 * 1.5), Percentiles(10, 20, 30),
                        Percentiles(100, 200, 300), "/r.json")


def test_table_text():
    assert format_table([_row("kvmesh", "concurrency=1", 80.0, 100.0),
                         _row("vllm", "concurrency=2", 160.0, 50.0, completed=3)]) == (
        "| system | tool | workload | load | ok / failed | req/s | output tok/s | TTFT p50 / p90 / "
        "p99 (ms) | ITL p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (ms) |\n"
        "|---|---|---|---|---|---:|---:|---:|---:|---:|\n"
        "| kvmesh | guidellm | fixed | concurrency=1 | 4 / 0 | 10.000 | 80.0 | 50.0 / 100.0 / 150.0 "
        "| 10.0 / 20.0 / 30.0 | 100.0 / 200.0 / 300.0 |\n"
        "| vllm | guidellm | fixed | concurrency=2 | 3 / 1 | 20.000 | 160.0 | 25.0 / 50.0 / 75.0 "
        "| 10.0 / 20.0 / 30.0 | 100.0 / 200.0 / 300.0 |")


def test_results_summary_and_plots_are_written(tmp_path):
    rows = [_row("kvmesh", f"concurrency={c}", 40.0 * c, 100.0 * c) for c in (1, 2, 4)]
    rows.append(LoadPointRow("vllm", "guidellm", "fixed", "concurrency=1", 0, 4, 0.0, 0.0,
                             Percentiles(math.nan, math.nan, math.nan),
                             Percentiles(math.nan, math.nan, math.nan),
                             Percentiles(math.nan, math.nan, math.nan), "/r.json"))
    meta = {"started": "2026-11-25 15:00:00 UTC", "cpu": "AMD EPYC, 2 vCPUs (avx2)",
            "loadavg_before": (9.5, 8.0, 7.0), "loadavg_after": (10.0, 9.0, 8.0),
            "settings": {"dtype": "float32"}, "errors": ["vllm / guidellm / fixed: exit status 1"]}
    write_results(rows, meta, ["# kvmesh", "kvmesh serve --port 1"], tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "load average before 9.50 / 8.00 / 7.00, after 10.00 / 9.00 / 8.00" in summary
    assert "- vllm / guidellm / fixed: exit status 1" in summary
    assert summary.endswith("## Commands\n\n```\n# kvmesh\nkvmesh serve --port 1\n```\n")
    assert "| vllm | guidellm | fixed | concurrency=1 | 0 / 4 | 0.000 | 0.0 | nan / nan / nan |" \
        in summary
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["load"] for r in saved["rows"]] == ["concurrency=1", "concurrency=2",
                                                   "concurrency=4", "concurrency=1"]
    assert saved["rows"][1]["ttft_ms"] == {"p50": 100.0, "p90": 200.0, "p99": 300.0}
    [png] = plot(rows, tmp_path)
    assert png.name == "latency_vs_throughput_fixed.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_output_folder_is_made_absolute(tmp_path, monkeypatch):
    """Each tool runs in its own folder: a relative report path would land inside it."""
    monkeypatch.chdir(tmp_path)
    assert serving.parse_args(["run", "--out", "rel/out"]).out == str(tmp_path / "rel" / "out")
    assert serving.parse_args(["scenarios", "--out", "s"]).out == str(tmp_path / "s")
