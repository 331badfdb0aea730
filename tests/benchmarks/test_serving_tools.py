"""The command lines the serving benchmark builds for guidellm and `vllm bench serve`, and where
it looks for each tool."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving_tools import (LoadPoint, Target, ToolMissing, Workload, guidellm_command,
                                      inference_perf_command, shell_line, tool_env, tool_prefix,
                                      vllm_bench_command)

TARGET = Target("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", Path("/models/tok"))
VARIED = Workload("varied", 128, 64, 0.75)
FIXED = Workload("fixed", 32, 16)


def test_varied_lengths_are_uniform_around_the_mean():
    assert VARIED.bounds(128) == (32, 224)
    assert VARIED.bounds(64) == (16, 112)
    # (224 - 32) / sqrt(12) = 55.4; (112 - 16) / sqrt(12) = 27.7
    assert (VARIED.stdev(128), VARIED.stdev(64)) == (55, 28)
    assert FIXED.bounds(32) == (32, 32) and FIXED.stdev(32) == 0


def test_load_point_labels():
    assert LoadPoint("concurrency", 4, 8).label == "concurrency=4"
    assert LoadPoint("rate", 2.5, 8).label == "rate=2.5"
    assert LoadPoint("rate", 2.0, 8).label == "rate=2"


def test_guidellm_command_sweeps_concurrency_with_one_run():
    argv = guidellm_command(["/v/bin/guidellm"], TARGET, VARIED,
                            [LoadPoint("concurrency", 1, 8), LoadPoint("concurrency", 4, 8)],
                            Path("/r/guidellm.json"), seed=3)
    assert argv == [
        "/v/bin/guidellm", "run",
        "--backend", "kind=openai_http,target=http://127.0.0.1:8000,model=SmolLM2-135M-Instruct,"
                     "request_format=/v1/completions",
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", "1,4",
        "--constraint", "kind=max_requests,count=8",
        "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64,prompt_tokens_stdev=55,"
                  "prompt_tokens_min=32,prompt_tokens_max=224,output_tokens_stdev=28,"
                  "output_tokens_min=16,output_tokens_max=112",
        "--tokenizer", "kind=hf_auto,model=/models/tok",
        "--seed", "kind=static,value=3",
        "--output", "kind=json,path=/r/guidellm.json",
        "--disable-console-interactive"]


def test_guidellm_command_rates_and_fixed_lengths():
    argv = guidellm_command(["g"], TARGET, FIXED, [LoadPoint("rate", 0.5, 6),
                                                   LoadPoint("rate", 2, 6)], Path("/r/g.json"))
    assert argv[argv.index("--profile") + 1] == "kind=constant,rate=0.5"
    assert argv[argv.index("--override") + 1:argv.index("--override") + 3] == ["profile.rate",
                                                                              "0.5,2"]
    assert argv[argv.index("--data") + 1] == "kind=synthetic_text,prompt_tokens=32,output_tokens=16"


def test_guidellm_command_refuses_mixed_points():
    with pytest.raises(ValueError, match="one kind and one request count"):
        guidellm_command(["g"], TARGET, FIXED, [LoadPoint("rate", 1, 6),
                                                LoadPoint("concurrency", 2, 6)], Path("/r"))
    with pytest.raises(ValueError, match="one kind and one request count"):
        guidellm_command(["g"], TARGET, FIXED, [LoadPoint("rate", 1, 6),
                                                LoadPoint("rate", 2, 7)], Path("/r"))


def test_vllm_bench_command_concurrency():
    argv = vllm_bench_command(["py", "vllm_cli.py", "bench", "serve"], TARGET, VARIED,
                              LoadPoint("concurrency", 4, 24), Path("/r"), "concurrency-4.json")
    assert argv == [
        "py", "vllm_cli.py", "bench", "serve", "--backend", "openai",
        "--base-url", "http://127.0.0.1:8000", "--endpoint", "/v1/completions",
        "--model", "SmolLM2-135M-Instruct", "--tokenizer", "/models/tok",
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--random-range-ratio", "0.75", "--num-prompts", "24",
        "--max-concurrency", "4", "--request-rate", "inf",
        "--ignore-eos", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", "/r", "--result-filename", "concurrency-4.json",
        "--disable-tqdm"]


def test_vllm_bench_command_rate():
    argv = vllm_bench_command(["v"], TARGET, FIXED, LoadPoint("rate", 2.5, 10), Path("/r"), "x.json")
    assert "--max-concurrency" not in argv
    assert argv[argv.index("--request-rate") + 1] == "2.5"
    assert argv[argv.index("--random-range-ratio") + 1] == "0"


def test_inference_perf_command():
    assert inference_perf_command(["/ip/bin/inference-perf"], Path("/r/config.yaml")) == [
        "/ip/bin/inference-perf", "--config_file", "/r/config.yaml"]


def test_tool_prefix_finds_each_tool_in_its_venv(tmp_path):
    for rel in ("bin/guidellm", "bin/inference-perf", "bin/python"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert tool_prefix("guidellm", tmp_path) == [str(tmp_path / "bin" / "guidellm")]
    assert tool_prefix("inference-perf", tmp_path) == [str(tmp_path / "bin" / "inference-perf")]
    prefix = tool_prefix("vllm-bench", tmp_path)
    assert prefix[0] == str(tmp_path / "bin" / "python")
    assert prefix[1].endswith("benchmarks/vllm_cli.py") and prefix[2:] == ["bench", "serve"]


@pytest.mark.parametrize("tool,hint", [
    ("guidellm", "pip install guidellm==0.8.1"),
    ("inference-perf", "python3.12 -m venv"),
    ("vllm-bench", "make "),
])
def test_a_missing_tool_says_how_to_install_it(tmp_path, tool, hint):
    with pytest.raises(ToolMissing, match=f"^{tool}: .* not found; install it with: ") as e:
        tool_prefix(tool, tmp_path / "absent")
    assert hint in str(e.value)


def test_tool_venvs_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_GUIDELLM_VENV", str(tmp_path / "g"))
    with pytest.raises(ToolMissing, match=str(tmp_path / "g" / "bin" / "guidellm")):
        tool_prefix("guidellm")


def test_a_tool_command_line_shows_its_environment():
    assert shell_line(["/v/bin/guidellm", "run", "--data", "kind=a,b=1 2"]) == (
        "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false "
        "/v/bin/guidellm run --data 'kind=a,b=1 2'")
    env = tool_env({"PATH": "/bin", "HF_HUB_OFFLINE": "0", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "9"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}        # kvmesh's wait policy is kvmesh's alone


def test_vllm_keeps_its_own_openmp_wait_policy(tmp_path):
    from benchmarks.serving_systems import EngineSettings, vllm_env
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2, "num_key_value_heads": 1, "hidden_size": 64, '
                                       '"num_attention_heads": 2}')
    s = EngineSettings(model, "bfloat16", 4, 128, 128, tmp_path / "venv")
    env, _ = vllm_env(s, {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "9"})
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    assert env["PATH"] == "/bin" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_kvmesh_command_line_names_the_openmp_wait_policy_when_set():
    from benchmarks.serving_systems import KVMESH_ENV_KEYS, _shell
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "GOMP_SPINCOUNT": "10000",
           "PATH": "/bin"}
    assert _shell(["kvmesh", "serve"], env, KVMESH_ENV_KEYS) == (
        "HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false GOMP_SPINCOUNT=10000 kvmesh serve")
