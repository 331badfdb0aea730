"""A step that raises: every in-flight client gets a clear 503, /health and /ready answer 503,
and the process exits 1 so that Kubernetes restarts it (instead of a dead engine behind a green
readiness probe)."""
from __future__ import annotations

import json
import threading
import time

import httpx
from servers import start_server

# NOTE: the fault lives in the server process: a sitecustomize on its PYTHONPATH wraps the model
# forward so that it raises once a trigger file exists; production code has no fault hooks.
FAULT = '''
import os
from kvmesh.engine import model_runner

_execute = model_runner.ModelRunner.execute

def _faulty_execute(self, out):
    if os.path.exists(os.environ["KVMESH_TEST_FAULT_FILE"]):
        raise RuntimeError("injected fault in the model forward")
    return _execute(self, out)

model_runner.ModelRunner.execute = _faulty_execute
'''


def test_a_failing_forward_fails_requests_then_probes_then_exits_nonzero(tmp_path):
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    trigger = tmp_path / "trigger"
    server = start_server(tmp_path, "--num-kv-blocks", "256", "--max-model-len", "512",
                          env={"PYTHONPATH": str(tmp_path / "fault"),
                               "KVMESH_TEST_FAULT_FILE": str(trigger)})
    try:
        events: list[dict] = []
        streamed = threading.Event()

        def stream() -> None:
            body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        streamed.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streamed.wait(60), server.log()[-2000:]
        trigger.touch()
        t.join(60)
        assert not t.is_alive()
        # the stream ends with one OpenAI-style error event, not a dropped connection
        assert events[-1]["error"]["code"] == "engine_dead"
        assert "injected fault in the model forward" in events[-1]["error"]["message"]
        assert all("choices" in e for e in events[:-1])
        # and the process exits 1 within seconds (probes answer 503 until it is gone)
        seen = set()
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                seen.add(("ready", httpx.get(f"{server.url}/ready", timeout=1).status_code))
                seen.add(("health", httpx.get(f"{server.url}/health", timeout=1).status_code))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.proc.poll() == 1, server.log()[-3000:]
        assert seen <= {("ready", 503), ("health", 503)}
        assert "engine failed" in server.log()
    finally:
        server.stop()


def test_probes_answer_503_once_the_engine_is_dead(smollm):
    """In process: /health and /ready turn 503 (with the cause) the moment the engine thread
    has failed, and a new request is refused with 503 engine_dead."""
    import asyncio

    from kvmesh.api.app import ServerState, create_app
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.async_engine import AsyncLLMEngine
    from kvmesh.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256), loaded=smollm)

    def boom(_sched):
        raise RuntimeError("injected")

    engine.runner.execute = boom
    died = threading.Event()
    async_engine = AsyncLLMEngine(engine, on_dead=lambda e: died.set())
    state = ServerState(engine=async_engine, model_name=engine.model_name,
                        max_model_len=engine.max_model_len, ready=True)
    app = create_app(state)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/ready")).status_code == 200
            async_engine.start()
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert died.wait(5)
            ready, health = await client.get("/ready"), await client.get("/health")
            assert (ready.status_code, ready.json()) == (503, {"status": "failed"})
            assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()
