"""Scale to zero end to end: the real kopf operator against kmock, a real `kvmesh router` process and a
real `kvmesh serve` engine (a tiny random model) that the test starts when the operator asks for it.

The test plays the kubelet: it writes the router's and the engine's Pod objects (Ready, with their
loopback IPs) into kmock, and starts the engine process once the operator scaled the Deployment to one.
NOTE: kmock ignores label selectors, so the operator's pod lists return both pods; the router listens
on 127.0.0.2 and the engine on 127.0.0.1, so each scrape reaches only the process it means.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from processes import RedisServer, free_port

from kvmesh.operator import resources as R
from kvmesh.operator.handlers import OperatorConfig

from .conftest import NAMESPACE, StampingEmulator, obj, wait_for
from .test_e2e_kmock import _create, _cr, _events, _post

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(120)]

ENGINE_PORT, ROUTER_PORT = free_port(), free_port()
ROUTER_HOST = "127.0.0.2"
SPEC = {"model": {}, "replicas": 0, "autoscaling": {
    "enabled": True, "minReplicas": 0, "maxReplicas": 2, "cooldownSeconds": 0, "scaleToZeroAfterSeconds": 2,
    "holdTimeoutSeconds": 90}}


@pytest.fixture()
def operator_config() -> OperatorConfig:
    return OperatorConfig(resync_seconds=0.3, cleanup_retries=2, cleanup_delay_seconds=0.1,
                          metrics_port=ENGINE_PORT, router_metrics_port=ROUTER_PORT)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2)
    return save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("m") / "tiny", seed=3)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    # NOTE: the engine's speed is not under test: the pure-torch kernels spare a C++ build in a fresh cache
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", KVMESH_CPU_KERNELS="0")
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "kvmesh.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    def ok() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    await wait_for(lambda: ok(), timeout=timeout, what=f"{url} ready")


async def _ready_pod(server: Any, name: str, component: str, ip: str) -> None:
    """Play the kubelet: a Ready pod of the service's `component` at `ip`."""
    svc_labels = {R.OWNER_LABEL: "zero", "app.kubernetes.io/component": component}
    await _post(server, f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "labels": svc_labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})


def _router_metric(name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"http://{ROUTER_HOST}:{ROUTER_PORT}/metrics", timeout=2.0).text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def _replicas(server: Any) -> int | None:
    return (obj(server, "apps/v1/deployments", "zero-engine") or {}).get("spec", {}).get("replicas")


async def test_a_request_wakes_a_scaled_to_zero_service_and_it_goes_back_to_zero(
        cluster: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    server = cluster
    redis_server = RedisServer()
    redis_server.start()
    engine_url = f"http://127.0.0.1:{ENGINE_PORT}"
    router_url = f"http://{ROUTER_HOST}:{ROUTER_PORT}"
    procs: list[subprocess.Popen] = []
    try:
        await _create(server, "zero", SPEC)
        await wait_for(lambda: _replicas(server) == 0, what="engine Deployment at zero")
        router = await wait_for(lambda: obj(server, "apps/v1/deployments", "zero-router"), what="router")
        router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        hold = router_args[router_args.index("--hold-timeout"):][:2]
        assert hold == ["--hold-timeout", "90"]
        # the router the operator rendered, as a process: its flags, on loopback
        procs.append(_spawn(["router", "--host", ROUTER_HOST, "--port", str(ROUTER_PORT),
                             "--redis-url", redis_server.url, "--backends", engine_url,
                             "--strategy", "least-loaded", "--served-model-name", "tiny", *hold,
                             "--log-level", "warning"], tmp_path / "router.log"))
        await _ready(router_url, procs[0], tmp_path / "router.log")   # ready with no engine: it holds
        await _ready_pod(server, "zero-router-0", "router", ROUTER_HOST)

        client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=90)
        answer = asyncio.ensure_future(asyncio.to_thread(
            client.completions.create, model="tiny", prompt="w5 w6 w7", max_tokens=4, temperature=0))
        await wait_for(lambda: _router_metric("kvmesh_router_pending_requests", model_name="tiny") == 1,
                       what="the request held by the router")
        await wait_for(lambda: _replicas(server) == 1, what="the operator scales the engines to one")
        assert ("Scaled", "1 request(s) held by the router: 0 → 1") in _events(server)
        assert not answer.done()

        # the Deployment controller and kubelet start the pod: here, the test
        procs.append(_spawn(["serve", "--host", "127.0.0.1", "--port", str(ENGINE_PORT), "--model",
                             str(tiny_model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                             "--num-kv-blocks", "32", "--max-model-len", "128", "--max-num-seqs", "4",
                             "--log-level", "warning"], tmp_path / "engine.log"))
        await _ready(engine_url, procs[1], tmp_path / "engine.log")
        await _ready_pod(server, "zero-engine-0", "engine", "127.0.0.1")

        completion = await asyncio.wait_for(answer, 60)
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.prompt_tokens == 3 and 1 <= completion.usage.completion_tokens <= 4
        # nothing lost, nothing sent twice: the engine finished exactly one request
        engine_metrics = httpx.get(f"{engine_url}/metrics").text
        finished = sum(float(line.split()[-1]) for line in engine_metrics.splitlines()
                       if line.startswith("kvmesh:request_success_total{"))
        assert finished == 1 + 1        # NOTE: the engine's start-up warm-up is a one-token request
        assert (_router_metric("kvmesh_router_held_requests_total", outcome="sent"),
                _router_metric("kvmesh_router_pending_requests", model_name="tiny")) == (1, 0)
        assert _cr(server, "zero")["status"]["lastActiveTime"]

        # idle for scaleToZeroAfterSeconds: back to zero
        await wait_for(lambda: _replicas(server) == 0, timeout=30, what="back to zero after the idle period")
        scaled = [m for r, m in _events(server) if r == "Scaled"]
        assert any(m.startswith("no request for ") and m.endswith("s (scaleToZeroAfterSeconds 2): 1 → 0")
                   for m in scaled), scaled
    finally:
        for p in procs:
            _stop(p)
        redis_server.stop()
