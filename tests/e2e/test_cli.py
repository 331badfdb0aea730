"""The `kvmesh` command line: offline generation and clear errors for bad input."""
from __future__ import annotations

import json
import subprocess
import sys

KVMESH = [sys.executable, "-m", "kvmesh.cli"]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*KVMESH, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_the_greedy_answer_as_text_and_json():
    res = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "12", "--json",
              "--num-kv-blocks", "64", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["text"] == "The capital of France is Paris."
    assert result["finish_reason"] == "stop"
    assert res.stdout.startswith("The capital of France is Paris.")


def test_bad_input_is_a_clear_cli_message(tmp_path):
    missing = tmp_path / "nope"
    res = run("generate", "hi", "--model", str(missing))
    assert res.returncode == 2 and f"model path does not exist: {missing}" in res.stderr
    res = run("serve", "--model", str(missing))
    assert res.returncode == 2 and "model path does not exist" in res.stderr
    res = run("serve", "--block-size", "3")
    assert res.returncode == 2 and "block_size must be a power of two" in res.stderr
    res = run("generate", "hi", "--scheduling-policy", "lifo")
    assert res.returncode == 2 and "invalid choice: 'lifo'" in res.stderr
    res = run("no-such-command")
    assert res.returncode == 2 and "invalid choice" in res.stderr
