"""kvmesh's router in front of two REAL vLLM engines (vLLM's CPU build), `make test-vllm`.

Both engines run `vllm serve` on the built-in model converted to an HF directory
(kvmesh.engine.hf_export), with prefix caching and vLLM's own ZMQ KV-event publisher; the router
runs with `--backend-kind vllm`. Shared-prefix requests must land on the engine that holds the
prefix (its own `vllm:prefix_cache_hits` counter proves it), and greedy output through the router
must equal kvmesh's own engine on the same weights.

Environment: KVMESH_VLLM_VENV (default ~/.cache/kvmesh/vllm-venv) holds vLLM; the machine's
cores are split between the two engines (VLLM_CPU_OMP_THREADS_BIND), each with 1 GiB of KV cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from kvmesh.engine.hf_export import builtin_hf_dir
from kvmesh.common.model_files import BUILTIN_MODEL_NAME

from processes import RedisServer, free_port
from waiting import wait_until

VENV = Path(os.environ.get("KVMESH_VLLM_VENV")
            or Path.home() / ".cache" / "kvmesh" / "vllm-venv")
START_TIMEOUT_S = float(os.environ.get("KVMESH_VLLM_START_TIMEOUT", "1500"))
BLOCK = 32          # vLLM's CPU attention takes multiples of 32 only
SYSTEM = {
    "alpha": "Alphacorp support desk. You are the assistant of Alphacorp, which sells garden "
             "tools. Answer politely and briefly, never reveal prices, and always suggest the "
             "Alphacorp help center for billing problems. Keep answers under three sentences.",
    "bravo": "Bravo Telecom support desk. You are the assistant of Bravo Telecom, which sells "
             "mobile phone plans. Answer politely and briefly, never promise coverage, and "
             "always suggest the Bravo help center for billing. Keep answers under three "
             "sentences.",
}
QUESTIONS = ["Hello, who are you?", "Question 1: can I get a refund?",
             "Question 2: where is my order?"]


def _preload(venv: Path) -> str:
    libs = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                        venv / "lib" / "libiomp5.so") if p.exists()]
    return ":".join(str(p) for p in libs)


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path, url: str) -> None:
        self.name, self.url = name, url
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self, tail: int = 4000) -> str:
        """The log's end, and before it every line that reports an error."""
        text = self.log_path.read_text(errors="replace")
        errors = [line for line in text.splitlines() if "Error" in line or "ERROR" in line]
        return "\n".join(errors[-20:]) + "\n...\n" + text[-tail:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _wait_ready(procs: list[Proc], path: str, timeout: float) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for p in list(pending):
            assert p.proc.poll() is None, f"{p.name} exited:\n{p.log()}"
            try:
                if httpx.get(p.url + path, timeout=2).status_code == 200:
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, "not ready: " + "\n".join(p.log() for p in pending)
        time.sleep(2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    python = VENV / "bin" / "python"
    assert (VENV / "bin" / "vllm").exists(), f"no vLLM at {VENV} (make test-vllm installs it)"
    model_dir = builtin_hf_dir("float32")
    # NOTE: the engines' logs outlive pytest's temporary directories (a first start compiles
    # for many minutes; a failure's cause is in these logs)
    log_dir = Path(os.environ.get("KVMESH_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rs = RedisServer()
    rs.start()
    cores = os.cpu_count() or 2
    engines: list[Proc] = []
    backends = []
    router = None
    try:
        for i in range(2):
            port, pub, replay = free_port(), free_port(), free_port()
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                      "topic": "kv-events"}
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                       VLLM_CPU_OMP_THREADS_BIND=str(i % cores), HF_HUB_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false", LD_PRELOAD=_preload(VENV),
                       PYTHONUNBUFFERED="1")
            engines.append(Proc(f"vllm-{i}", [
                # NOTE: not the `vllm` script: it asks for the version of a package named
                # "vllm", and the CPU build's is "vllm-cpu"; the server module is the same server
                str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", BUILTIN_MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--block-size", str(BLOCK), "--enable-prefix-caching", "--max-model-len", "2048",
                "--max-num-seqs", "4", "--kv-events-config", json.dumps(events),
                # NOTE: eager mode: torch.compile of the model took over 10 minutes per engine
                # on this loaded 2-core machine (and two engines compiling at once broke each
                # other's compile cache); routing and greedy output do not depend on it
                *(() if os.environ.get("KVMESH_VLLM_COMPILE") == "1" else ("--enforce-eager",))],
                env, log_dir, f"http://127.0.0.1:{port}"))
            backends.append(f"vllm=http://127.0.0.1:{port}#kv-events={pub},{replay}")
        _wait_ready(engines, "/health", START_TIMEOUT_S)
        rport = free_port()
        router = Proc("router", [
            sys.executable, "-m", "kvmesh.cli", "router", "--host", "127.0.0.1",
            "--port", str(rport), "--redis-url", rs.url, "--backends", *backends,
            "--block-size", str(BLOCK), "--expose-route-headers", "--lookup-timeout", "2",
            "--log-level", "info"], dict(os.environ, HF_HUB_OFFLINE="1"), log_dir,
            f"http://127.0.0.1:{rport}")
        _wait_ready([router], "/ready", 180)
        client = redis.Redis(port=rs.port, decode_responses=True)
        assert wait_until(lambda: len(client.keys("*:pod:*")) == 2, timeout=30), router.log()
        client.close()
        yield engines, router
    finally:
        for p in [*engines, *([router] if router else [])]:
            p.stop()
        rs.stop()


def chat(url: str, system: str, user: str, max_tokens: int = 2) -> httpx.Response:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": BUILTIN_MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) on a Prometheus page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prefix_hits(engines) -> dict[str, float]:
    return {e.url: metric_sum(httpx.get(f"{e.url}/metrics", timeout=10).text,
                              "vllm:prefix_cache_hits_total") for e in engines}


def _prompt(system: str, user: str) -> list[int]:
    from kvmesh.prompt.sources import load_tokenizer   # noqa: PLC0415
    return load_tokenizer(None).apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefix_requests_land_on_the_vllm_engine_holding_the_prefix(cluster):
    engines, router = cluster
    holders = {}
    for name, system in SYSTEM.items():
        r = chat(router.url, system, QUESTIONS[0])
        assert r.headers["x-kvmesh-route-reason"] == "no-prefix"
        holders[name] = r.headers["x-kvmesh-backend"]
        time.sleep(1.5)          # vLLM publishes the step's events; the subscriber writes them
    before = prefix_hits(engines)
    # at least the full blocks each request shares with its family's first request
    floor = dict.fromkeys(before, 0)
    for question in QUESTIONS[1:]:
        for name, system in SYSTEM.items():
            r = chat(router.url, system, question)
            backend = r.headers["x-kvmesh-backend"]
            assert (backend, r.headers["x-kvmesh-route-reason"]) == (holders[name], "prefix-hit")
            first, this = _prompt(system, QUESTIONS[0]), _prompt(system, question)
            floor[backend] += min(_common(first, this), len(this) - 1) // BLOCK * BLOCK
    after = prefix_hits(engines)
    print("vllm:prefix_cache_hits_total before", before, "after", after, "floor", floor,
          "holders", holders)
    for url in after:
        # every request the router sent to an engine hit that engine's cache for its family's
        # shared blocks; an engine the router sent nothing to gained no hits
        assert after[url] - before[url] >= floor[url] > 0 or floor[url] == 0
        if floor[url] == 0:
            assert after[url] == before[url]
    assert sum(floor.values()) >= 2 * len(SYSTEM) * BLOCK


def test_greedy_output_through_the_router_equals_kvmesh_on_the_same_weights(cluster):
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling_params import SamplingParams
    engines, router = cluster
    convs = [[{"role": "system", "content": s}, {"role": "user", "content": q}]
             for s in SYSTEM.values() for q in QUESTIONS]
    got = [chat(router.url, c[0]["content"], c[1]["content"], max_tokens=24)
           .json()["choices"][0]["message"]["content"] for c in convs]
    llm = LLM(None, dtype="float32", num_kv_blocks=256, max_model_len=2048, cpu_threads=1)
    want = [o.outputs[0].text for o in llm.chat(convs, SamplingParams(max_tokens=24,
                                                                      temperature=0.0))]
    assert got == want
