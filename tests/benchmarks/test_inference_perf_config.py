"""inference-perf configs: the exact text written, and the load scenarios taken from the one
place `load_scenarios.py` takes them from. The schema check runs inference-perf's own config
reader when its venv is present (it is not installed by `make test`)."""
from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks import inference_perf_config as ipc
from benchmarks.load_scenarios import DEFAULTS, QUICK
from benchmarks.load_stats import send_offsets
from benchmarks.scenario_configs import load_args, scenario_requests, write_scenario
from benchmarks.serving_tools import LoadPoint, Target, Workload, default_venv
from benchmarks.workload import WorkloadRequest

TARGET = Target("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", Path("/models/tok"))

SWEEP_YAML = """\
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: SmolLM2-135M-Instruct
  base_url: http://127.0.0.1:8000
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: /models/tok
storage:
  local_storage:
    path: /r/reports
report:
  request_lifecycle:
    summary: true
    per_stage: true
    percentiles:
    - 50
    - 90
    - 99
  prometheus: null
data:
  type: random
  input_distribution:
    type: fixed
    min: 32
    max: 32
    mean: 32
    std_dev: 0
    total_count: 4
  output_distribution:
    type: fixed
    min: 16
    max: 16
    mean: 16
    std_dev: 0
    total_count: 4
load:
  type: concurrent
  stages:
  - num_requests: 4
    concurrency_level: 1
  - num_requests: 4
    concurrency_level: 2
  num_workers: 1
  base_seed: 0
"""


def test_sweep_config_text_for_a_concurrency_sweep():
    cfg = ipc.sweep_config(TARGET, Workload("fixed", 32, 16),
                           [LoadPoint("concurrency", 1, 4), LoadPoint("concurrency", 2, 4)],
                           Path("/r/reports"))
    assert ipc.dump_yaml(cfg) == SWEEP_YAML


def test_sweep_config_varied_lengths_and_rates():
    cfg = ipc.sweep_config(TARGET, Workload("varied", 128, 64, 0.75),
                           [LoadPoint("rate", 0.5, 5), LoadPoint("rate", 2, 5)], Path("/r"), seed=7)
    assert cfg["data"]["input_distribution"] == {"type": "uniform", "min": 32, "max": 224,
                                                 "mean": 128, "std_dev": 55, "total_count": 5}
    assert cfg["data"]["output_distribution"] == {"type": "uniform", "min": 16, "max": 112,
                                                  "mean": 64, "std_dev": 28, "total_count": 5}
    # each stage lasts until its requests have arrived: ceil(5 / 0.5) = 10 s, ceil(5 / 2) = 3 s
    assert cfg["load"] == {"type": "constant", "stages": [{"rate": 0.5, "duration": 10},
                                                           {"rate": 2, "duration": 3}],
                           "num_workers": 1, "base_seed": 7}


def test_sweep_config_refuses_mixed_points():
    with pytest.raises(ValueError, match="one kind"):
        ipc.sweep_config(TARGET, Workload("fixed", 8, 8),
                         [LoadPoint("rate", 1, 2), LoadPoint("concurrency", 1, 2)], Path("/r"))


def test_scenario_trace_text():
    reqs = [WorkloadRequest(0.5, 1, 0, 10, 9), WorkloadRequest(3.25, 2, 1, 40, 39),
            WorkloadRequest(61.0, 1, 3, 128, 127)]
    assert ipc.scenario_trace(reqs, time_scale=2.0) == (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2026-01-01 00:00:00.250000,10,9\n"
        "2026-01-01 00:00:01.625000,40,39\n"
        "2026-01-01 00:00:30.500000,128,127\n")


def test_scenario_config_replays_the_trace():
    cfg = ipc.scenario_config(TARGET, Path("/t/trace_low.csv"), Path("/t/reports_low"), seed=1)
    assert cfg["data"] == {"type": "random", "trace": {"file": "/t/trace_low.csv",
                                                       "format": "AzurePublicDataset"}}
    assert cfg["load"] == {"type": "trace_replay", "stages": [{"rate": 1, "duration": 1}],
                           "trace": {"file": "/t/trace_low.csv", "format": "AzurePublicDataset"},
                           "num_workers": 1, "base_seed": 1}
    assert cfg["storage"] == {"local_storage": {"path": "/t/reports_low"}}


@pytest.mark.parametrize("quick,base", [(False, DEFAULTS), (True, QUICK)])
def test_scenarios_use_load_scenarios_own_settings(quick, base):
    la = load_args(quick, seed=0)
    assert {k: getattr(la, k) for k in base} == base


def test_scenario_trace_is_the_list_load_scenarios_replays(tmp_path):
    la = load_args(False, seed=0)
    reqs = scenario_requests("medium", la)
    assert len(reqs) == DEFAULTS["max_requests"]
    trace, config = write_scenario("medium", la, TARGET, tmp_path)
    lines = trace.read_text().splitlines()[1:]
    assert len(lines) == len(reqs)
    for line, r, off in zip(lines, reqs, send_offsets(reqs, la.time_scale)):
        stamp, prompt, output = line.split(",")
        sent = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
        assert ((sent - ipc._TRACE_T0).total_seconds(), int(prompt), int(output)) == (
            pytest.approx(off, abs=1e-6), r.prompt_len, r.output_len)
    assert config.name == "inference_perf_medium.yaml"
    assert f"file: {trace.resolve()}" in config.read_text()


def _ip_python() -> Path:
    return default_venv("inference-perf") / "bin" / "python"


@pytest.mark.skipif(not _ip_python().is_file(),
                    reason="inference-perf's venv is absent (serving_tools.py says how to install it)")
def test_inference_perf_accepts_every_config(tmp_path):
    la = load_args(True, 0)
    configs = []
    for name in ("low", "medium", "high"):
        configs.append(write_scenario(name, la, TARGET, tmp_path)[1])
    for i, cfg in enumerate([
            ipc.sweep_config(TARGET, Workload("varied", 64, 32, 0.5),
                             [LoadPoint("concurrency", 1, 4), LoadPoint("concurrency", 4, 4)],
                             tmp_path / "r"),
            ipc.sweep_config(TARGET, Workload("fixed", 64, 32), [LoadPoint("rate", 1.5, 4)],
                             tmp_path / "r")]):
        configs.append(tmp_path / f"sweep{i}.yaml")
        configs[-1].write_text(ipc.dump_yaml(cfg))
    code = ("import sys\nfrom inference_perf.config import read_config\n"
            "for p in sys.argv[1:]:\n    c = read_config(p)\n    print(c.load.type.value, "
            "len(c.load.stages))\n")
    done = subprocess.run([str(_ip_python()), "-c", code, *map(str, configs)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:5] == ["trace_replay 1"] * 3 + ["concurrent 2", "constant 1"]
