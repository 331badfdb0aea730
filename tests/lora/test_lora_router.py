"""The router over LoRA engines (issue 24's router part), all real: one redis-server, two
`kvmesh serve --enable-lora` engines with different `--lora-modules` (adapters made by peft) and a
shared `--lora-resolver-dir`, and two `kvmesh router` processes (one with
`--lora-load-on-demand`), driven through the official openai client.

    pod-a: x, y      pod-b: x, z      resolver dir: w (good), broken (rank over --max-lora-rank)

The tests run in file order on one cluster; each uses prompts of its own, so the prefix index
holds only what that test cached.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from processes import RedisServer, free_port
from waiting import wait_until

from kvmesh.common.block_hash import hash_hex, hash_prompt_blocks
from kvmesh.index.layout import KeySpace

BLOCK = 4
ENGINE = ("--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
          "--max-cpu-loras", "4", "--block-size", str(BLOCK), "--num-kv-blocks", "256",
          "--max-model-len", "128", "--cpu-threads", "1", "--dtype", "float32",
          "--log-level", "warning")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Cluster:
    redis: RedisServer
    engines: dict[str, Proc]          # pod id -> engine
    router: Proc                      # unknown adapters: 404
    on_demand: Proc                   # --lora-load-on-demand

    def pod_of(self, url: str) -> str:
        return next(p for p, e in self.engines.items() if e.url == url.rstrip("/"))


def _spawn(name: str, argv: list[str], port: int, logs: Path) -> Proc:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log = logs / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log)


def _wait_ready(procs: list[Proc], timeout: float = 240.0) -> None:
    for p in procs:
        def ready(p=p) -> bool:
            assert p.proc.poll() is None, f"{p.name} exited:\n{p.tail()}"
            try:
                return httpx.get(f"{p.url}/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(ready, timeout, 0.25), f"{p.name} not ready:\n{p.tail()}"


@pytest.fixture(scope="module")
def cluster(llama_base, llama_adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-router")
    resolver = tmp / "resolver"
    shutil.copytree(llama_adapters["qv-rslora"], resolver / "w")
    shutil.copytree(llama_adapters["all"], resolver / "broken")
    config = json.loads((resolver / "broken" / "adapter_config.json").read_text())
    (resolver / "broken" / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    rs = RedisServer()
    rs.start()
    modules = {"pod-a": (f"x={llama_adapters['all']}", f"y={llama_adapters['qv-rslora']}"),
               "pod-b": (f"x={llama_adapters['all']}", f"z={llama_adapters['o-down']}")}
    procs: list[Proc] = []
    try:
        engines = {}
        for pod, mods in modules.items():
            port = free_port()
            engines[pod] = _spawn(pod, [
                "serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(llama_base),
                *ENGINE, "--redis-url", rs.url, "--pod-id", pod,
                "--advertise-url", f"http://127.0.0.1:{port}", "--lora-resolver-dir",
                str(resolver), "--lora-modules", *mods], port, tmp)
            procs.append(engines[pod])
        routers = []
        for name, extra in (("router", ()), ("on-demand", ("--lora-load-on-demand",))):
            port = free_port()
            routers.append(_spawn(name, [
                "router", "--host", "127.0.0.1", "--port", str(port), "--redis-url", rs.url,
                "--backends", *[e.url for e in engines.values()], "--model", str(llama_base),
                "--served-model-name", "tiny", "--block-size", str(BLOCK),
                "--expose-route-headers", "--lookup-timeout", "2", "--log-level", "warning",
                *extra], port, tmp))
            procs.append(routers[-1])
        _wait_ready(procs)
        c = Cluster(rs, engines, *routers)
        # the routers have read the engines' heartbeats and adapters: y routes, to pod-a
        for r in routers:
            assert wait_until(lambda r=r: _post(r, "y", [3, 4, 5]).status_code == 200, 30, 0.2), \
                r.tail()
        assert wait_until(lambda: len(rs.client().keys("*pod:pod-*")) == 2, 15)
        time.sleep(0.6)              # NOTE: the routers read heartbeats every ~250 ms
        yield c
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        codes = {p.name: p.proc.wait(60) for p in procs}
        rs.stop()
    assert codes == dict.fromkeys(codes, 0), codes


def _post(p: Proc, model: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{p.url}/v1/completions", timeout=60.0, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True})


def _client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)


def _routed(c: Cluster, router: Proc, model: str, prompt: list[int]) -> tuple[str, str]:
    """(pod, route reason) of one completion through `router`, by the openai client."""
    raw = _client(router).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True})
    assert raw.parse().model == model
    return c.pod_of(raw.headers["x-kvmesh-backend"]), raw.headers["x-kvmesh-route-reason"]


def _counter(e: Proc, lora: str) -> float:
    text = httpx.get(f"{e.url}/metrics").text
    want = f'kvmesh:lora_requests_total{{finished_reason="length",lora_name="{lora}",model_name="tiny"}}'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(want + " "))


def test_adapter_traffic_goes_to_the_pods_that_hold_it(cluster):
    before = {pod: (_counter(e, "y"), _counter(e, "z")) for pod, e in cluster.engines.items()}
    for i in range(3):
        assert _routed(cluster, cluster.router, "y", [10 + i, 11, 12])[0] == "pod-a"
        assert _routed(cluster, cluster.router, "z", [20 + i, 21, 22])[0] == "pod-b"
    after = {pod: (_counter(e, "y"), _counter(e, "z")) for pod, e in cluster.engines.items()}
    # each pod's per-adapter counter saw exactly the 3 requests routed to it
    assert {p: (a[0] - before[p][0], a[1] - before[p][1]) for p, a in after.items()} == \
        {"pod-a": (3.0, 0.0), "pod-b": (0.0, 3.0)}


def test_an_adapter_no_backend_holds_is_a_404_naming_it(cluster):
    for model in ("nope", "w"):          # w is only in the resolver dir: not loaded anywhere
        with pytest.raises(openai.NotFoundError) as e:
            _client(cluster.router).completions.create(model=model, prompt=[5, 6], max_tokens=1)
        assert e.value.body == {"message": f"The model `{model}` does not exist.",
                                "type": "not_found_error", "param": "model",
                                "code": "model_not_found"}
    # the router's body is the one an engine answers for a name it does not serve
    assert _post(cluster.engines["pod-a"], "nope", [5, 6]).json()["error"] == {
        "message": "The model `nope` does not exist.", "type": "not_found_error",
        "param": "model", "code": "model_not_found"}
    assert all("w" not in _models(e) for e in cluster.engines.values())


def _models(e: Proc) -> dict[str, str | None]:
    return {m["id"]: m.get("parent") for m in httpx.get(f"{e.url}/v1/models").json()["data"]}


def _cache(c: Cluster, pod: str, model: str, prompt: list[int]) -> None:
    """Run `prompt` on `pod` directly, then wait until its last block is in the index."""
    assert _post(c.engines[pod], model, prompt).status_code == 200
    last = hash_prompt_blocks(prompt, BLOCK, lora_name=None if model == "tiny" else model)[-1]
    key = KeySpace.from_env().block("tiny", hash_hex(last))
    client = c.redis.client()
    try:
        assert wait_until(lambda: client.exists(key) == 1, 10)
    finally:
        client.close()


def test_prefix_lookup_counts_only_the_adapters_own_blocks(cluster):
    """pod-a holds P's blocks as the base model and as y, pod-b as x: a request to x with P is
    routed to pod-b by its prefix; a request to x with Q, which pod-a holds only as the base and
    as y, finds no prefix anywhere."""
    p = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]       # 3 full blocks
    q = [50, 51, 52, 53, 54, 55, 56, 57, 58]                        # 2 full blocks
    for model in ("tiny", "y"):
        _cache(cluster, "pod-a", model, p)
        _cache(cluster, "pod-a", model, q)
    _cache(cluster, "pod-b", "x", p)
    assert _routed(cluster, cluster.router, "x", p) == ("pod-b", "prefix-hit")
    assert _routed(cluster, cluster.router, "x", q)[1] == "no-prefix"
    assert _routed(cluster, cluster.router, "y", p) == ("pod-a", "prefix-hit")
    assert _routed(cluster, cluster.router, "tiny", p) == ("pod-a", "prefix-hit")


def test_on_demand_an_unknown_adapter_is_loaded_where_it_is_routed(cluster):
    pod, reason = _routed(cluster, cluster.on_demand, "w", [60, 61, 62])
    assert reason == "no-prefix"
    engine = cluster.engines[pod]
    assert _models(engine)["w"] == "tiny"
    other = next(e for p, e in cluster.engines.items() if p != pod)
    assert "w" not in _models(other)
    # the router without on-demand learns where w now is, and sends it only there
    assert wait_until(lambda: _post(cluster.router, "w", [3, 4]).status_code == 200, 10, 0.2)
    assert {_routed(cluster, cluster.router, "w", [70 + i, 71])[0] for i in range(3)} == {pod}
    # a name the resolver does not find is the engine's 404; a refused adapter its 400
    with pytest.raises(openai.NotFoundError) as e:
        _client(cluster.on_demand).completions.create(model="nope", prompt=[5, 6], max_tokens=1)
    assert e.value.body["message"] == "The model `nope` does not exist."
    with pytest.raises(openai.BadRequestError) as e:
        _client(cluster.on_demand).completions.create(model="broken", prompt=[5, 6], max_tokens=1)
    assert e.value.body["message"].startswith(
        "LoRA adapter 'broken' was found but could not be loaded: ")
    assert "rank" in e.value.body["message"]
    assert all("broken" not in _models(e) for e in cluster.engines.values())
