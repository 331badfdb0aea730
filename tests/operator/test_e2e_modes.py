"""The real kopf operator against kmock: the vLLM runtime, router.mode inference-pool (with and without
the RBAC for InferencePools), the Redis password Secret rolling the pods, and the finalizer's caBundle."""
from __future__ import annotations

import asyncio
import re
from typing import Any

import kmock
import pytest

from .conftest import NAMESPACE, StampingEmulator, obj, wait_for
from .test_e2e_kmock import _cond, _cr, _create, _events, _make_ready, _post

pytestmark = [pytest.mark.kmock(cls=StampingEmulator), pytest.mark.timeout(60)]

PVC_MODEL = {"source": "pvc", "pvc": {"claimName": "weights", "path": "m"}, "servedModelName": "m"}
CHECKSUM = "kvmesh.io/redis-auth-checksum"


def _template_annotations(server: Any, name: str) -> dict[str, str]:
    dep = obj(server, "apps/v1/deployments", name) or {}
    return ((dep.get("spec") or {}).get("template") or {}).get("metadata", {}).get("annotations") or {}


async def test_vllm_runtime_and_switching_back(cluster: Any) -> None:
    server = cluster
    await _create(server, "vl", {"model": PVC_MODEL, "image": "vllm/vllm-openai:v0.11.0", "gpu": {"count": 2},
                                 "engine": {"runtime": "vllm"}})
    engine = await wait_for(lambda: obj(server, "apps/v1/deployments", "vl-engine"), what="vLLM engine")
    (c,) = engine["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["command"], c["args"][:1]) == ("vllm/vllm-openai:v0.11.0", ["vllm", "serve"], ["/models/m"])
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    router = await wait_for(lambda: obj(server, "apps/v1/deployments", "vl-router"), what="router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--backend-kind"):] == ["--backend-kind", "vllm", "--kv-events-port", "5557",
                                                   "--kv-events-replay-port", "5558", "--kv-events-topic", "kv-events"]
    headless = obj(server, "v1/services", "vl-engine")
    assert [p["port"] for p in headless["spec"]["ports"]] == [8000, 5557, 5558]
    assert obj(server, "v1/configmaps", "vl-engine-config") is None  # vLLM takes flags, not kvmesh's config
    for name in ("vl-engine", "vl-router", "vl-redis"):
        _make_ready(server, name, 1)
    await wait_for(lambda: _cr(server, "vl")["status"]["phase"] == "Ready", what="Ready")

    # back to kvmesh engines: the config appears, the ZMQ ports and the router's vLLM flags go
    await _post(server, f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/vl",
                {"spec": {"engine": {"runtime": "kvmesh"}, "image": None}}, method="patch",
                content_type="application/merge-patch+json")
    await wait_for(lambda: obj(server, "v1/configmaps", "vl-engine-config"), what="engine config")
    engine = await wait_for(lambda: (d := obj(server, "apps/v1/deployments", "vl-engine"))
                            and "command" not in d["spec"]["template"]["spec"]["containers"][0] and d,
                            what="kvmesh engine")
    assert engine["spec"]["template"]["spec"]["containers"][0]["args"][:3] == [
        "serve", "--config", "/etc/kvmesh/engine.json"]
    await wait_for(lambda: "--backend-kind" not in obj(server, "apps/v1/deployments", "vl-router")["spec"][
        "template"]["spec"]["containers"][0]["args"], what="router without vLLM flags")
    assert [p["port"] for p in obj(server, "v1/services", "vl-engine")["spec"]["ports"]] == [8000]


async def test_inference_pool_mode(cluster: Any) -> None:
    server = cluster
    await _create(server, "pool", {"model": PVC_MODEL, "router": {"mode": "inference-pool"}})
    pool = await wait_for(lambda: obj(server, "inference.networking.k8s.io/v1/inferencepools", "pool"),
                          what="InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "pool-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    for resource, name in (("v1/serviceaccounts", "pool-epp"), ("rbac.authorization.k8s.io/v1/roles", "pool-epp"),
                           ("rbac.authorization.k8s.io/v1/rolebindings", "pool-epp"),
                           ("v1/configmaps", "pool-epp-config"), ("apps/v1/deployments", "pool-epp"),
                           ("v1/services", "pool-epp")):
        assert obj(server, resource, name) is not None, (resource, name)
    assert obj(server, "apps/v1/deployments", "pool-router") is None  # llm-d's picker replaces kvmesh's router
    engine = obj(server, "apps/v1/deployments", "pool-engine")
    assert "--kv-events-config" in engine["spec"]["template"]["spec"]["containers"][0]["args"]
    for name in ("pool-engine", "pool-epp", "pool-redis"):
        _make_ready(server, name, 1)
    cr = await wait_for(lambda: (c := _cr(server, "pool")) and _cond(c, "Ready").get("reason")
                        == "InferencePoolNotReady" and c, what="everything ready but the pool")
    assert _cond(cr, "InferencePoolReady")["reason"] == "NoParents"
    assert (cr["status"]["phase"], _cond(cr, "Ready")["reason"]) == ("Progressing", "InferencePoolNotReady")
    # a gateway accepts the pool (we play its controller): the CR copies the parents' conditions
    key = (kmock.resource("inference.networking.k8s.io/v1/inferencepools"), NAMESPACE, "pool")
    server.objects[key].patch({"status": {"parents": [{
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw", "namespace": NAMESPACE},
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"},
                       {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}})
    cr = await wait_for(lambda: (c := _cr(server, "pool")) and c["status"]["phase"] == "Ready" and c, what="Ready")
    assert {k: v for k, v in _cond(cr, "InferencePoolReady").items() if k != "lastTransitionTime"} == {
        "type": "InferencePoolReady", "status": "True", "reason": "Accepted",
        "message": f"Gateway {NAMESPACE}/gw: Accepted=True (Accepted), ResolvedRefs=True (ResolvedRefs)"}

    # back to the built-in router: the pool and the picker's objects are deleted, the router created
    await _post(server, f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/pool",
                {"spec": {"router": {"mode": "builtin"}}}, method="patch",
                content_type="application/merge-patch+json")
    await wait_for(lambda: obj(server, "apps/v1/deployments", "pool-router"), what="router")
    await wait_for(lambda: obj(server, "inference.networking.k8s.io/v1/inferencepools", "pool") is None,
                   what="pool deleted")
    for resource, name in (("v1/serviceaccounts", "pool-epp"), ("apps/v1/deployments", "pool-epp"),
                           ("v1/configmaps", "pool-epp-config"), ("rbac.authorization.k8s.io/v1/roles", "pool-epp")):
        await wait_for(lambda r=resource, n=name: obj(server, r, n) is None, what=f"{resource} {name} deleted")
    cr = await wait_for(lambda: (c := _cr(server, "pool")) and not _cond(c, "InferencePoolReady") and c,
                        what="condition gone")


FORBIDDEN = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
             "message": "forbidden"}


async def test_inference_pool_without_its_rbac_says_so(cluster: Any) -> None:
    """rbac.inferencePool=false: the API server answers 403 for pools and the picker's identity and rights."""
    server = cluster
    server[re.compile(r"/apis/inference\.networking\.k8s\.io/.*")] << 403 << FORBIDDEN
    server[re.compile(r"/apis/rbac\.authorization\.k8s\.io/.*")] << 403 << FORBIDDEN
    server[re.compile(r"/api/v1/namespaces/[^/]+/serviceaccounts.*")] << 403 << FORBIDDEN
    # a builtin-mode service is untouched by the missing rights (the stale-pool reads are refused)
    await _create(server, "plain", {"model": {}})
    cr = await wait_for(lambda: (c := _cr(server, "plain")) and (c.get("status") or {}).get("phase") and c,
                        what="status")
    assert "InferencePoolReady" not in [c["type"] for c in cr["status"]["conditions"]]
    await _create(server, "nopool", {"model": PVC_MODEL, "router": {"mode": "inference-pool"}})
    cr = await wait_for(lambda: (c := _cr(server, "nopool")) and _cond(c, "InferencePoolReady") and c,
                        what="InferencePoolReady")
    assert {k: v for k, v in _cond(cr, "InferencePoolReady").items() if k != "lastTransitionTime"} == {
        "type": "InferencePoolReady", "status": "False", "reason": "Forbidden",
        "message": "the operator may not manage InferencePool objects: install the chart with "
                   "rbac.inferencePool=true (and the InferencePool CRD)"}
    assert obj(server, "apps/v1/deployments", "nopool-engine") is not None
    assert obj(server, "apps/v1/deployments", "nopool-epp") is not None
    await asyncio.sleep(0.8)  # a few resyncs
    assert not [e for e in _events(server) if e[0] == "ApplyFailed"]


async def test_a_deleted_redis_password_is_regenerated_and_rolls_the_pods(cluster: Any) -> None:
    """Without the Secret watch: the resync recreates it and every pod template gets the new checksum."""
    server = cluster
    await _create(server, "rot", {"model": {}})
    secret = await wait_for(lambda: obj(server, "v1/secrets", "rot-redis-auth"), what="password Secret")
    names = ("rot-engine", "rot-router", "rot-redis")
    first = await wait_for(lambda: all(CHECKSUM in _template_annotations(server, n) for n in names)
                           and {_template_annotations(server, n)[CHECKSUM] for n in names}, what="checksums")
    (old,) = first
    await wait_for(lambda: _cr(server, "rot")["status"]["redisAuthChecksum"] == old, what="checksum in status")
    async with server.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/secrets/rot-redis-auth") as resp:
        assert resp.status == 200
    new_secret = await wait_for(lambda: obj(server, "v1/secrets", "rot-redis-auth"), what="a new Secret")
    assert new_secret["stringData"]["password"] != secret["stringData"]["password"]
    rolled = await wait_for(lambda: (s := {_template_annotations(server, n).get(CHECKSUM) for n in names})
                            and len(s) == 1 and old not in s and s, what="pods rolled")
    await wait_for(lambda: _cr(server, "rot")["status"]["redisAuthChecksum"] in rolled, what="status checksum")


async def test_a_rotated_external_password_rolls_the_pods(cluster: Any) -> None:
    server = cluster
    path = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    await _post(server, path, {"apiVersion": "v1", "kind": "Secret", "data": {"password": "b2xk"},  # "old"
                               "metadata": {"name": "ext-auth", "namespace": NAMESPACE}})
    await _create(server, "xr", {"model": {}, "redis": {"url": "redis://r.infra:6379/0",
                                                        "passwordSecret": {"name": "ext-auth"}}})
    before = await wait_for(lambda: _template_annotations(server, "xr-engine").get(CHECKSUM), what="checksum")
    await wait_for(lambda: _template_annotations(server, "xr-router").get(CHECKSUM) == before, what="router too")
    await _post(server, f"{path}/ext-auth", {"data": {"password": "bmV3"}}, method="patch",  # "new"
                content_type="application/merge-patch+json")
    after = await wait_for(lambda: (a := _template_annotations(server, "xr-engine").get(CHECKSUM)) != before and a,
                           what="engine rolled")
    await wait_for(lambda: _template_annotations(server, "xr-router")[CHECKSUM] == after, what="router rolled")
    # the Secret deleted: the pods keep running on the last password (no roll into pods that cannot start)
    async with server.request("DELETE", f"{path}/ext-auth") as resp:
        assert resp.status == 200
    await asyncio.sleep(1.0)
    assert _template_annotations(server, "xr-engine")[CHECKSUM] == after


CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
TLS_SPEC = {"model": {}, "redis": {"url": "rediss://redis.infra:6380/0", "caBundle": {"configMap": "redis-ca"}}}


async def test_the_finalizer_cleans_a_tls_redis_with_the_ca_bundle(cluster: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.operator import redis_cleanup
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(redis_cleanup, "cleanup", lambda *args: calls.append(args) or 3)
    server = cluster
    await _post(server, f"/api/v1/namespaces/{NAMESPACE}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "data": {"ca.crt": CA_PEM},
        "metadata": {"name": "redis-ca", "namespace": NAMESPACE}})
    await _create(server, "tls", TLS_SPEC)
    await wait_for(lambda: (c := _cr(server, "tls")) and (c.get("status") or {}).get("phase"), what="status")
    async with server.request("DELETE", f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/tls") as r:
        assert r.status == 200
    await wait_for(lambda: _cr(server, "tls") is None, what="released")
    # NOTE: kopf may run the (idempotent) deletion handler a second time against kmock
    assert set(calls) == {("rediss://redis.infra:6380/0", None, NAMESPACE, "tls", CA_PEM)}


async def test_a_missing_ca_bundle_fails_the_cleanup_loudly(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.operator import redis_cleanup
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(redis_cleanup, "cleanup", lambda *args: calls.append(args) or 0)
    server = cluster
    await _create(server, "tls2", TLS_SPEC)
    await wait_for(lambda: (c := _cr(server, "tls2")) and (c.get("status") or {}).get("phase"), what="status")
    async with server.request("DELETE", f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/tls2") as r:
        assert r.status == 200
    await wait_for(lambda: _cr(server, "tls2") is None, what="released despite the missing CA")
    assert calls == []  # never connected without the CA it was told to trust
    events = await wait_for(lambda: [e for e in _events(server) if e[0] == "RedisCleanupFailed"], what="event")
    assert events == [("RedisCleanupFailed", "gave up removing keys kvmesh:team-a/tls2:* after 2 attempts: "
                                             "redis.caBundle: ConfigMap redis-ca has no key 'ca.crt'")]
