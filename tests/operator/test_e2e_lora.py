"""spec.loraAdapters end to end: the real kopf operator against kmock, and a real `kvmesh serve
--enable-lora` process standing in for the engine pod (kmock's Pod has podIP 127.0.0.1 and the
operator's engine port is the process' port). Adapters are made with peft on a tiny random Llama."""
from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
import pytest
from lora_adapters import make_adapter, make_base
from servers import start_server

from kvmesh.operator.handlers import OperatorConfig

from .conftest import CR_PATH, NAMESPACE, StampingEmulator, obj, wait_for
from .test_e2e_kmock import _cond, _cr, _events, _post

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(180)]

ADMIN_KEY = "adm-key"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-op")
    base = make_base("llama", root / "base")
    return {"base": str(base),
            "sql": str(make_adapter(base, root / "sql", ["q_proj", "v_proj"], r=4, alpha=8, seed=1)),
            "chat": str(make_adapter(base, root / "chat", ["o_proj"], r=8, alpha=16, seed=2)),
            "big": str(make_adapter(base, root / "big", ["q_proj"], r=32, alpha=32, seed=3))}


@pytest.fixture(scope="module")
def engine(adapters, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("lora-engine"), "--model", adapters["base"], "--served-model-name",
                       "smol", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--admin-api-key",
                       ADMIN_KEY, "--cpu-threads", "1", "--num-kv-blocks", "64", "--block-size", "4",
                       "--max-model-len", "128")
    yield srv
    assert srv.stop() == 0


@pytest.fixture()
def operator_config(engine) -> OperatorConfig:
    port = int(engine.url.rsplit(":", 1)[1])
    return OperatorConfig(resync_seconds=0.3, cleanup_retries=2, cleanup_delay_seconds=0.1, metrics_port=port,
                          lora_retry_seconds=3600)


def _served(engine) -> dict[str, str]:
    data = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["root"] for m in data if m.get("parent") is not None}


async def _pod(server: Any, name: str, ready: bool, owner: str = "lo", ip: str = "127.0.0.1") -> None:
    """Play the kubelet: an engine pod of `owner` at `ip`, Ready or not."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE,
                        "labels": {"app.kubernetes.io/component": "engine", "kvmesh.io/inference-service": owner}},
           "spec": {"containers": [{"name": "engine", "image": "kvmesh"}]},
           "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}}
    if obj(server, "v1/pods", name) is None:
        await _post(server, f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
    else:
        await _post(server, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"status": pod["status"]},
                    method="patch", content_type="application/merge-patch+json")


async def test_adapters_follow_the_spec_on_running_pods_without_a_rollout(cluster: Any, engine, adapters) -> None:
    server = cluster
    assert _served(engine) == {}
    await _post(server, f"/api/v1/namespaces/{NAMESPACE}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "admin", "namespace": NAMESPACE},
        "data": {"admin-api-key": base64.b64encode(ADMIN_KEY.encode()).decode()}})
    spec = {"model": {}, "router": {"enabled": False}, "adminApiKeySecret": {"name": "admin"},
            "engine": {"maxLoras": 2},
            "loraAdapters": [{"name": "sql", "source": adapters["sql"]}, {"name": "chat", "source": adapters["chat"]}]}
    await _post(server, CR_PATH, {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                                  "metadata": {"name": "lo", "namespace": NAMESPACE}, "spec": spec})
    engine_dep = await wait_for(lambda: obj(server, "apps/v1/deployments", "lo-engine"), what="engine Deployment")
    config = obj(server, "v1/configmaps", "lo-engine-config")
    assert '"enable_lora": true' in config["data"]["engine.json"]

    # a pod that is not ready yet is left alone
    await _pod(server, "lo-engine-1", ready=False)
    cr = await wait_for(lambda: (c := _cr(server, "lo")) and _cond(c, "AdaptersReady").get("reason") == "AwaitingPods"
                        and c, what="AdaptersReady AwaitingPods")
    assert _served(engine) == {}
    assert cr["status"]["loraAdapters"] == [
        {"name": "sql", "source": adapters["sql"], "pods": [], "ready": False, "reason": "Loading"},
        {"name": "chat", "source": adapters["chat"], "pods": [], "ready": False, "reason": "Loading"}]

    # once ready, it gets the spec's adapters through the admin endpoint
    await _pod(server, "lo-engine-1", ready=True)
    cr = await wait_for(lambda: (c := _cr(server, "lo")) and _cond(c, "AdaptersReady").get("status") == "True"
                        and c, what="AdaptersReady True")
    assert _served(engine) == {"sql": adapters["sql"], "chat": adapters["chat"]}
    assert (_cond(cr, "AdaptersReady")["reason"], _cond(cr, "AdaptersReady")["message"]) == (
        "AllAdaptersLoaded", "2 adapter(s) on 1 ready engine pod(s)")
    assert [(a["name"], a["pods"], a["ready"]) for a in cr["status"]["loraAdapters"]] == [
        ("sql", ["lo-engine-1"], True), ("chat", ["lo-engine-1"], True)]
    r = httpx.post(f"{engine.url}/v1/completions", timeout=60,
                   json={"model": "sql", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert (r.status_code, r.json()["model"]) == (200, "sql")

    # chat removed, big added (rank 32 over --max-lora-rank 16): chat unloaded, big refused, sql stays
    await _post(server, f"{CR_PATH}/lo", {"spec": {"loraAdapters": [
        {"name": "sql", "source": adapters["sql"]}, {"name": "big", "source": adapters["big"]}]}},
        method="patch", content_type="application/merge-patch+json")
    cr = await wait_for(lambda: (c := _cr(server, "lo")) and _cond(c, "AdaptersReady").get("reason") == "RankTooLarge"
                        and c, what="AdaptersReady RankTooLarge")
    refusal = "LoRA adapter 'big': rank 32 exceeds --max-lora-rank 16; raise --max-lora-rank"
    assert (_cond(cr, "AdaptersReady")["status"], _cond(cr, "AdaptersReady")["message"]) == (
        "False", f"big (RankTooLarge): lo-engine-1: {refusal}")
    assert cr["status"]["loraAdapters"] == [
        {"name": "sql", "source": adapters["sql"], "pods": ["lo-engine-1"], "ready": True, "reason": "Loaded"},
        {"name": "big", "source": adapters["big"], "pods": [], "ready": False, "reason": "RankTooLarge",
         "message": f"lo-engine-1: {refusal}"}]
    assert _served(engine) == {"sql": adapters["sql"]}
    events = await wait_for(lambda: (e := _events(server)) and [x for x in e if x[0] == "LoRAAdapterRefused"] and e,
                            what="the refusal's Event")
    assert [e for e in events if e[0].startswith("LoRA")] == [
        ("LoRAAdapterLoaded", f"loaded sql from {adapters['sql']} on lo-engine-1"),
        ("LoRAAdapterLoaded", f"loaded chat from {adapters['chat']} on lo-engine-1"),
        ("LoRAAdapterUnloaded", "unloaded chat from lo-engine-1"),
        ("LoRAAdapterRefused", f"lo-engine-1 refused big: {refusal}")]
    await asyncio.sleep(1.0)  # a few resyncs: refused once, not asked again (lora_retry_seconds)
    assert len([e for e in _events(server) if e[0] == "LoRAAdapterRefused"]) == 1

    # no rollout: the engine Deployment and its ConfigMap are as they were
    dep = obj(server, "apps/v1/deployments", "lo-engine")
    assert dep["spec"] == engine_dep["spec"]
    assert dep["metadata"]["generation"] == engine_dep["metadata"]["generation"]
    assert obj(server, "v1/configmaps", "lo-engine-config")["data"] == config["data"]

    # the list emptied, enableLora kept on: every adapter unloaded, still no rollout
    await _post(server, f"{CR_PATH}/lo", {"spec": {"loraAdapters": None, "engine": {"enableLora": True}}},
                method="patch", content_type="application/merge-patch+json")
    cr = await wait_for(lambda: (c := _cr(server, "lo")) and _cond(c, "AdaptersReady").get("reason") == "NoAdapters"
                        and c, what="AdaptersReady NoAdapters")
    assert _served(engine) == {}
    assert obj(server, "apps/v1/deployments", "lo-engine")["spec"] == engine_dep["spec"]
    assert cr["status"]["loraAdapters"] == []

    # LoRA off: a config change (a rollout), and neither the condition nor status.loraAdapters stays
    await _post(server, f"{CR_PATH}/lo", {"spec": {"engine": {"enableLora": False}}},
                method="patch", content_type="application/merge-patch+json")
    cr = await wait_for(lambda: (c := _cr(server, "lo")) and c["status"]["observedGeneration"] == 4
                        and not _cond(c, "AdaptersReady") and c, what="LoRA off")
    assert "loraAdapters" not in cr["status"]
    assert '"enable_lora"' not in obj(server, "v1/configmaps", "lo-engine-config")["data"]["engine.json"]


async def test_an_unreadable_admin_key_or_an_unreachable_pod_is_shown(cluster: Any, engine) -> None:
    import re
    server = cluster
    # the chart's default rbac.readSecrets=false: every Secret read is refused
    server[re.compile(rf"/api/v1/namespaces/{NAMESPACE}/secrets/.*")] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": "secrets is forbidden"}
    lora = [{"name": "sql", "source": "/opt/loras/sql"}]
    await _post(server, CR_PATH, {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                                  "metadata": {"name": "locked", "namespace": NAMESPACE},
                                  "spec": {"model": {}, "router": {"enabled": False}, "redis": {
                                      "url": "redis://r:6379/0"}, "apiKeySecret": {"name": "keys"},
                                      "loraAdapters": lora}})
    cr = await wait_for(lambda: (c := _cr(server, "locked")) and _cond(c, "AdaptersReady") and c,
                        what="AdaptersReady")
    assert {k: v for k, v in _cond(cr, "AdaptersReady").items() if k != "lastTransitionTime"} == {
        "type": "AdaptersReady", "status": "False", "reason": "SecretUnreadable",
        "message": "the operator may not read Secret keys (spec.apiKeySecret), whose key the engines' adapter "
                   "endpoints require: install the chart with rbac.readSecrets=true"}
    # no key needed, but the pod's address does not answer (nothing listens on 127.0.0.2)
    await _post(server, CR_PATH, {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                                  "metadata": {"name": "gone", "namespace": NAMESPACE},
                                  "spec": {"model": {}, "router": {"enabled": False}, "loraAdapters": lora}})
    await _pod(server, "gone-engine-1", ready=True, owner="gone", ip="127.0.0.2")
    cr = await wait_for(lambda: (c := _cr(server, "gone")) and _cond(c, "AdaptersReady").get("reason")
                        == "PodUnreachable" and c, what="AdaptersReady PodUnreachable")
    (status,) = cr["status"]["loraAdapters"]
    port = engine.url.rsplit(":", 1)[1]
    assert (status["ready"], status["pods"]) == (False, [])
    assert status["message"].startswith(f"gone-engine-1: cannot read http://127.0.0.2:{port}/v1/models: ")
    assert _served(engine) == {}


async def test_a_missing_key_secret_or_key_is_shown(cluster: Any) -> None:
    server = cluster
    await _post(server, f"/api/v1/namespaces/{NAMESPACE}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys", "namespace": NAMESPACE},
        "data": {"other": base64.b64encode(b"x").decode()}})
    for name, secrets, message in (
            ("nokey", {"apiKeySecret": {"name": "keys"}}, "Secret keys (spec.apiKeySecret) has no key 'api-key'"),
            ("nosecret", {"adminApiKeySecret": {"name": "absent"}},
             "Secret absent (spec.adminApiKeySecret) does not exist: the engines cannot start without it either")):
        await _post(server, CR_PATH, {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                                      "metadata": {"name": name, "namespace": NAMESPACE},
                                      "spec": {"model": {}, "router": {"enabled": False}, **secrets,
                                               "loraAdapters": [{"name": "sql", "source": "/opt/loras/sql"}]}})
        cr = await wait_for(lambda: (c := _cr(server, name)) and _cond(c, "AdaptersReady") and c,
                            what=f"AdaptersReady of {name}")
        assert (_cond(cr, "AdaptersReady")["reason"], _cond(cr, "AdaptersReady")["message"]) == (
            "SecretMissing", message)
