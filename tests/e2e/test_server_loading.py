"""A request while the model loads (issue 31): 503 `model is loading` with Retry-After, never 404
"The model ... does not exist"; /health says the process lives, /ready that it cannot serve yet.

In-process checks of every route on an app whose model is not loaded, then a real `kvmesh serve`
whose loading is held back by a test-only gate, driven by the official `openai` client and raw
httpx (for the header).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from processes import free_port
from waiting import wait_until

from kvmesh.api.app import ServerState, create_app

MODEL = "SmolLM2-135M-Instruct"
KEY = "loading-key"
LOADING = {"error": {"message": "model is loading", "type": "service_unavailable", "param": None,
                     "code": "not_ready"}}
ROUTES = [("POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
          ("POST", "/v1/chat/completions",
           {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
          ("POST", "/v1/embeddings", {"model": "no-such-model", "input": "hi"}),
          ("POST", "/tokenize", {"model": "no-such-model", "prompt": "hi"}),
          ("POST", "/detokenize", {"model": "no-such-model", "tokens": [1]}),
          ("GET", "/v1/models", None)]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_answers_503_model_is_loading_before_it_looks_at_the_model(method, path, body):
    r = TestClient(create_app(ServerState())).request(method, path, json=body)
    assert (r.status_code, r.json(), r.headers["retry-after"]) == (503, LOADING, "5")


def test_a_load_that_failed_is_a_503_naming_the_failure_not_loading_forever():
    state = ServerState(load_error="model loading failed: no such file")
    r = TestClient(create_app(state)).post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.json()["error"] == {"message": "model loading failed: no such file",
                                 "type": "service_unavailable", "param": None,
                                 "code": "load_failed"}


# ---- a real server whose load waits for the test ----------------------------------------------
# NOTE: test-only: a sitecustomize on the server's PYTHONPATH holds LLMEngine's construction until
# the gate file exists; production code has no such hook.
GATE = '''
import time
import os

from kvmesh.engine import engine as _engine

_init = _engine.LLMEngine.__init__


def _gated(self, *args, **kwargs):
    while not os.path.exists(os.environ["KVMESH_TEST_LOAD_GATE"]):
        time.sleep(0.05)
    _init(self, *args, **kwargs)


_engine.LLMEngine.__init__ = _gated
'''


def test_a_server_that_is_still_loading_answers_503_with_retry_after_then_serves(tmp_path):
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "sitecustomize.py").write_text(GATE)
    gate = tmp_path / "open"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path / "gate"),
               KVMESH_TEST_LOAD_GATE=str(gate))
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port), "--api-key", KEY,
             "--num-kv-blocks", "64", "--max-model-len", "256", "--disable-uvicorn-access-log"],
            stdout=out, stderr=err, env=env)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        assert wait_until(lambda: _status(f"{url}/health") == 200, timeout=120, interval=0.1), \
            (tmp_path / "err.log").read_text()
        # alive, not ready: the probes tell the truth while the model loads
        assert httpx.get(f"{url}/ready").json() == {"status": "loading"}
        assert _status(f"{url}/ready") == 503

        for name, call in [
            ("completions", lambda: client.completions.create(model=MODEL, prompt="hi",
                                                              max_tokens=1)),
            ("chat", lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)),
            ("a model name it cannot know yet", lambda: client.completions.create(
                model="no-such-model", prompt="hi", max_tokens=1)),
            ("models", lambda: client.models.list()),
        ]:
            with pytest.raises(openai.InternalServerError) as e:
                call()
            assert (e.value.status_code, e.value.body) == (503, LOADING["error"]), name
            assert e.value.response.headers["retry-after"] == "5", name

        r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=10,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert (r.status_code, r.headers["retry-after"], r.json()) == (503, "5", LOADING)
        # the key is still checked first
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401

        gate.touch()
        assert wait_until(lambda: _status(f"{url}/ready") == 200, timeout=180, interval=0.1), \
            (tmp_path / "err.log").read_text()
        done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
        assert e.value.body["code"] == "model_not_found"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, (tmp_path / "err.log").read_text()[-3000:]
    # --disable-uvicorn-access-log: not one access line for the ~dozen requests above
    assert "HTTP/1.1" not in (tmp_path / "out.log").read_text()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
