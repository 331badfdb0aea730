"""`kvmesh serve --tensor-parallel-size N`: a size that does not fit is a CLI message; a server
whose worker is SIGKILLed mid-stream fails the stream with engine_dead, answers 503 on its
probes, exits 1 within seconds and leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import torch
from servers import start_server
from tiny_models import save_tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM


def test_a_size_that_does_not_fit_the_model_is_a_cli_error():
    # NOTE: the allocator restart's notice and the info-level "malloc:" log line come before
    # any check of the command line (tests/e2e/test_allocator.py); this test reads the message
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--tensor-parallel-size", "2",
                        "--allocator", "none", "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "kvmesh serve: error: --tensor-parallel-size 2 does not fit LlamaForCausalLM: the number of "
        "query heads (9) is not divisible by 2; the number of KV heads (3) is not divisible by 2 "
        "(sizes that fit this model: 3)")
    assert "Traceback" not in r.stderr


def _workers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if any("spawn_main" in part for part in p.cmdline())]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_killed_worker_fails_the_stream_then_the_probes_then_the_server(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2)
    path = save_tiny_model(Qwen2ForCausalLM(cfg), tmp_path / "qwen2", seed=3)
    server = start_server(tmp_path, "--model", str(path), "--tensor-parallel-size", "2",
                          "--cpu-threads", "1", "--num-kv-blocks", "512", "--max-model-len", "4096")
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 1, [p.cmdline() for p in workers]
        family = [server.proc.pid] + [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        from openai import OpenAI
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        done = client.completions.create(model="qwen2", prompt="w5 w6 w7", max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 5
        events: list[dict] = []
        streamed = threading.Event()

        def stream() -> None:
            body = {"prompt": "w5 w6 w7 w8", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        streamed.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streamed.wait(60), server.log()[-2000:]
        os.kill(workers[0].pid, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        assert events[-1]["error"]["code"] == "engine_dead", events[-1]
        assert "tensor-parallel worker rank 1" in events[-1]["error"]["message"]
        assert "killed by SIGKILL" in events[-1]["error"]["message"]
        seen = set()
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                seen.add(("ready", httpx.get(f"{server.url}/ready", timeout=1).status_code))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.proc.poll() == 1, server.log()[-3000:]
        assert seen <= {("ready", 503)}
        deadline = time.monotonic() + 10        # the resource tracker exits on its pipe's EOF
        while (alive := _alive(family)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"processes left behind: {alive}"
    finally:
        server.stop()
