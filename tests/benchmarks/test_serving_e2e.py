"""benchmarks/serving.py end to end, opt-in: the real tools (each in its own venv) against a real
`kvmesh serve` (and, with KVMESH_TEST_SERVING_SYSTEMS, the router or vLLM), at toy size.

    KVMESH_TEST_SERVING=1 .venv/bin/python -m pytest tests/benchmarks/test_serving_e2e.py

`make test` leaves it out: the tools are not installed by it (see benchmarks/serving_tools.py,
or `make bench-serving`, which installs them). A tool whose venv is absent is skipped by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving_tools import TOOLS, ToolMissing, tool_prefix

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving.py"

if os.environ.get("KVMESH_TEST_SERVING") != "1":
    pytest.skip("opt-in: KVMESH_TEST_SERVING=1 runs the field's load generators (minutes)",
                allow_module_level=True)


def _available() -> tuple[list[str], list[str]]:
    have, missing = [], []
    for tool in TOOLS:
        try:
            tool_prefix(tool)
            have.append(tool)
        except ToolMissing as e:
            missing.append(str(e))
    return have, missing


# NOTE: a server start and every tool's run: longer than the suite's default per-test timeout
pytestmark = pytest.mark.timeout(3600)

HAVE, MISSING = _available()
SYSTEMS = os.environ.get("KVMESH_TEST_SERVING_SYSTEMS", "kvmesh")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not HAVE:
        pytest.skip("no load generator venv is present: " + "; ".join(MISSING))
    out = tmp_path_factory.mktemp("serving")
    argv = [sys.executable, str(SCRIPT), "run", "--systems", SYSTEMS, "--tools", ",".join(HAVE),
            "--workloads", "fixed,varied", "--concurrency", "1,2", "--num-requests", "2",
            "--prompt-tokens", "16", "--output-tokens", "8", "--max-num-seqs", "4",
            "--max-model-len", "256", "--max-num-batched-tokens", "256", "--vllm-enforce-eager",
            "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    return done, out


def test_it_succeeds(run):
    done, _ = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_every_tool_gave_a_row_per_system_workload_and_point(run):
    _, out = run
    rows = json.loads((out / "results.json").read_text())["rows"]
    got = sorted((r["system"], r["tool"], r["workload"], r["load"]) for r in rows)
    assert got == sorted((s, t, w, f"concurrency={c}") for s in SYSTEMS.split(",") for t in HAVE
                         for w in ("fixed", "varied") for c in (1, 2))
    for r in rows:
        assert (r["completed"], r["failed"]) == (2, 0), r
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] < r["e2e_ms"]["p99"], r
        assert Path(r["report"]).exists()


def test_the_summary_holds_every_command_that_ran(run):
    _, out = run
    summary = (out / "summary.md").read_text()
    commands = json.loads((out / "results.json").read_text())["commands"]
    assert summary.split("## Commands\n\n```\n", 1)[1].rstrip("`\n").splitlines() == commands
    # per system and workload: one guidellm run, one inference-perf run, one vllm bench per point
    per_system = sum({"guidellm": 2, "inference-perf": 2, "vllm-bench": 4}[t] for t in HAVE)
    tool_lines = [c for c in commands if c.startswith("HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ")]
    assert len(tool_lines) == per_system * len(SYSTEMS.split(","))
    assert (out / "latency_vs_throughput_fixed.png").is_file()



def test_a_load_scenario_replays_through_inference_perf(tmp_path):
    if "inference-perf" not in HAVE:
        pytest.skip("inference-perf's venv is absent: " + "; ".join(MISSING))
    done = subprocess.run([sys.executable, str(SCRIPT), "scenarios", "--run", "--quick",
                           "--policies", "fcfs", "--scenarios", "low", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads((tmp_path / "results.json").read_text())["rows"]
    trace_lines = (tmp_path / "fcfs" / "trace_low.csv").read_text().splitlines()[1:]
    assert (row["system"], row["workload"], row["load"]) == ("kvmesh (fcfs)", "low", "trace")
    assert (row["completed"], row["failed"]) == (len(trace_lines), 0)
