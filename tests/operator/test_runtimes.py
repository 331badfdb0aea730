"""Tensor parallelism, the vLLM runtime, KV events and the router's tenant flags: exact objects for exact
specs, validated against the Kubernetes OpenAPI schemas."""
from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from kvmesh.operator import crd
from kvmesh.operator import resources as R
from kvmesh.operator import runtimes as RT

from .examples import load_example

OWNER = R.Owner(name="qwen", uid="0b6c2f4e-1111-2222-3333-444455556666")
K8S_VERSION = "1.32.0"
VLLM = {"model": {"source": "pvc", "pvc": {"claimName": "qwen-weights", "path": "Qwen2.5-7B-Instruct"},
                  "servedModelName": "qwen"},
        "image": "vllm/vllm-openai:v0.11.0", "gpu": {"count": 2}, "engine": {"runtime": "vllm"}}
KV_EVENTS = ('{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
             '"replay_endpoint":"tcp://*:5558","buffer_steps":10000,"topic":"kv-events"}')


def _svc(spec: dict[str, Any], name: str = "qwen") -> crd.InferenceService:
    return crd.parse(name, "llm", spec)


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _example(name: str) -> crd.InferenceService:
    cr = load_example(name)
    return crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])


# ---- tensor parallelism ------------------------------------------------------------------------------
def test_a_two_gpu_engine_shards_across_both_with_nccl_shared_memory() -> None:
    svc = _example("full.yaml")
    dep = R.build_engine_deployment(svc, OWNER, 2)
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    c = _container(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert json.loads(R.build_config_map(svc, OWNER)["data"]["engine.json"])["tensor_parallel_size"] == 2
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in \
        dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["NCCL_DEBUG"], env["NCCL_SOCKET_IFNAME"]) == ("WARN", "eth0")


@pytest.mark.parametrize(("spec", "tp", "shm", "nccl"), [
    ({}, None, "2Gi", []),                                                   # one GPU: no TP, no NCCL
    ({"gpu": {"count": 4}}, 4, "8Gi", [{"name": "NCCL_DEBUG", "value": "WARN"}]),
    ({"gpu": {"count": 4}, "engine": {"tensorParallelSize": 2, "nccl": {"debug": "INFO"}}}, 2, "8Gi",
     [{"name": "NCCL_DEBUG", "value": "INFO"}]),
    ({"gpu": {"count": 4}, "engine": {"tensorParallelSize": 1}}, None, "2Gi", []),
    ({"gpu": {"count": 0}}, None, "2Gi", []),                                # CPU
], ids=["1-gpu", "4-gpus", "tp-2-of-4", "tp-1-of-4", "cpu"])
def test_tensor_parallel_size_shared_memory_and_nccl_env(spec: dict[str, Any], tp: int | None, shm: str,
                                                         nccl: list[dict[str, str]]) -> None:
    svc = _svc({"model": {}, **spec})
    config = json.loads(R.build_config_map(svc, OWNER)["data"]["engine.json"])
    assert config.get("tensor_parallel_size") == tp  # left out at 1: the flag's default, the old config hash
    dep = R.build_engine_deployment(svc, OWNER, 1)
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}} in volumes
    assert [e for e in _container(dep)["env"] if e["name"].startswith("NCCL_")] == nccl


def test_one_gpu_specs_keep_their_config_hash() -> None:
    """tensor_parallel_size and cache_salt_from are written only when set: no rollout on operator upgrade."""
    svc = _svc({"model": {}})
    assert set(R.engine_config(svc)) == {
        "model", "served_model_name", "tokenizer", "max_num_seqs", "max_num_batched_tokens", "block_size",
        "kv_cache_memory_fraction", "scheduling_policy", "enable_prefix_caching", "preemption_mode", "redis_url"}
    assert R.config_hash(svc) == R.config_hash(_svc({"model": {}, "engine": {"tensorParallelSize": 1}}))
    assert R.config_hash(svc) != R.config_hash(_svc({"model": {}, "gpu": {"count": 2}}))


# ---- the vLLM runtime ----------------------------------------------------------------------------------
def test_vllm_engine_runs_vllm_serve_with_the_equivalent_flags() -> None:
    svc = _svc({**VLLM, "engine": {"runtime": "vllm", "maxNumSeqs": 64, "maxNumBatchedTokens": 4096,
                                   "blockSize": 32, "kvCacheMemoryFraction": 0.8, "schedulingPolicy": "priority"},
                "model": {**VLLM["model"], "tokenizer": "/models/tok"},
                "apiKeySecret": {"name": "keys"}, "tracing": {"otlpEndpoint": "http://otel:4317"}})
    dep = R.build_engine_deployment(svc, OWNER, 2)
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    c = _container(dep)
    assert c["image"] == "vllm/vllm-openai:v0.11.0"
    assert c["command"] == ["vllm", "serve"]
    assert c["args"] == [
        "/models/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "2", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
        "--block-size", "32", "--gpu-memory-utilization", "0.8", "--scheduling-policy", "priority",
        "--enable-prefix-caching", "--tokenizer", "/models/tok", "--kv-events-config", KV_EVENTS]
    assert json.loads(c["args"][-1]) == RT.kv_events_config(svc)
    # probes on vLLM's own endpoint (unauthenticated even with --api-key, unlike /v1/models)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
                          {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"}]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    assert (env["HOME"], env["HF_HUB_OFFLINE"], env["PYTHONHASHSEED"]) == ("/tmp", "1", "42")
    assert env["VLLM_CACHE_ROOT"] == "/home/kvmesh/.cache/vllm"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    # vLLM talks to no Redis and reads no kvmesh config file
    assert not {"KVMESH_REDIS_PASSWORD", "KVMESH_SERVICE", "KVMESH_API_KEY"} & set(env)
    pod = dep["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["model-cache", "tmp", "dshm", "model"]
    assert "kvmesh.io/config-hash" not in dep["spec"]["template"]["metadata"]["annotations"]


def test_the_kv_cache_dtype_reaches_either_engine_and_auto_keeps_the_config_hash() -> None:
    cpu = _svc({"model": {}, "gpu": {"count": 0}, "engine": {"kvCacheDtype": "fp8_e5m2"}})
    assert R.engine_config(cpu)["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in R.engine_config(_svc({"model": {}}))
    assert R.engine_config(_svc({"model": {}, "engine": {"kvCacheDtype": "auto"}})) == \
        R.engine_config(_svc({"model": {}}))
    vllm = _svc({**VLLM, "engine": {"runtime": "vllm", "kvCacheDtype": "fp8"}})
    args = RT.vllm_args(vllm, "/models/m")
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in RT.vllm_args(_svc({**VLLM, "engine": {"runtime": "vllm"}}), "/models/m")


def test_vllm_children_have_no_engine_config_and_a_router_following_the_kv_events() -> None:
    svc = _svc(VLLM)
    children = R.build_children(svc, OWNER, 1)
    for obj in children:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert [R.child_key(c) for c in children] == [
        ("networking.k8s.io/v1", "NetworkPolicy", "qwen-redis"), ("apps/v1", "Deployment", "qwen-redis"),
        ("v1", "Service", "qwen-redis"), ("v1", "Service", "qwen-engine"), ("apps/v1", "Deployment", "qwen-engine"),
        ("apps/v1", "Deployment", "qwen-router"), ("v1", "Service", "qwen")]
    router = next(c for c in children if c["metadata"]["name"] == "qwen-router")
    rc = _container(router)
    assert rc["image"] == "ghcr.io/kvmesh/kvmesh:0.1.0"  # kvmesh's router, not the vLLM image
    assert rc["args"] == [
        "router", "--host", "0.0.0.0", "--port", "8080", "--redis-url", "redis://qwen-redis.llm.svc:6379/0",
        "--discover-headless-service", "qwen-engine", "--strategy", "kv-aware", "--served-model-name", "qwen",
        "--block-size", "16", "--model", "/models/Qwen2.5-7B-Instruct", "--backend-kind", "vllm",
        "--kv-events-port", "5557", "--kv-events-replay-port", "5558", "--kv-events-topic", "kv-events"]
    headless = next(c for c in children if R.child_key(c) == ("v1", "Service", "qwen-engine"))
    assert headless["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
        {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"},
        {"name": "kv-replay", "port": 5558, "targetPort": "kv-replay", "protocol": "TCP"}]
    assert ("v1", "ConfigMap", "qwen-engine-config") in R.possible_children(svc)  # deleted on a switch


def test_kvmesh_engines_behind_the_builtin_router_publish_to_redis_only() -> None:
    svc = _svc({"model": {}})
    assert RT.kv_events_config(svc) is None and RT.router_backend_args(svc) == []
    c = _container(R.build_engine_deployment(svc, OWNER, 1))
    assert "--kv-events-config" not in c["args"]
    assert [p["name"] for p in c["ports"]] == ["http"]
    assert [p["name"] for p in R.build_engine_service(svc, OWNER)["spec"]["ports"]] == ["http"]


# ---- router flags and the admin key (issue 12) ----------------------------------------------------------
@pytest.mark.parametrize(("router", "extra"), [
    ({}, []),
    ({"cacheSaltFrom": "api-key"}, ["--cache-salt-from", "api-key"]),
    ({"cacheSaltFrom": "header:X-Tenant-Id", "exposeRouteHeaders": True},
     ["--cache-salt-from", "header:X-Tenant-Id", "--expose-route-headers"]),
])
def test_router_tenant_flags_follow_the_spec(router: dict[str, Any], extra: list[str]) -> None:
    svc = _svc({"model": {}, "router": router}, name="smol")
    assert R.router_args(svc)[15:] == extra
    # the engines salt their blocks the same way (the router must look up what they stored)
    assert R.engine_config(svc).get("cache_salt_from") == router.get("cacheSaltFrom")


def test_admin_api_key_reaches_the_engines_only() -> None:
    svc = _svc({"model": {}, "adminApiKeySecret": {"name": "ops-keys"}}, name="smol")
    engine_env = _container(R.build_engine_deployment(svc, OWNER, 1))["env"]
    assert {"name": "KVMESH_ADMIN_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "ops-keys", "key": "admin-api-key"}}} in engine_env
    router_env = _container(R.build_router_deployment(svc, OWNER))["env"]
    assert "KVMESH_ADMIN_API_KEY" not in [e["name"] for e in router_env]
    no_key = _container(R.build_engine_deployment(_svc({"model": {}}), OWNER, 1))["env"]
    assert "KVMESH_ADMIN_API_KEY" not in [e["name"] for e in no_key]


def test_redis_auth_checksum_annotates_the_pod_templates() -> None:
    svc = _svc({"model": {}}, name="smol")
    children = {R.child_key(c): c for c in R.build_children(svc, OWNER, 1, redis_auth="abc123")}
    for name in ("smol-engine", "smol-router"):
        template = children[("apps/v1", "Deployment", name)]["spec"]["template"]
        assert template["metadata"]["annotations"]["kvmesh.io/redis-auth-checksum"] == "abc123"
    unknown = {R.child_key(c): c for c in R.build_children(svc, OWNER, 1)}
    template = unknown[("apps/v1", "Deployment", "smol-engine")]["spec"]["template"]
    assert "kvmesh.io/redis-auth-checksum" not in template["metadata"]["annotations"]
