"""The pure builders: exact objects for exact specs, validated against the Kubernetes OpenAPI schemas."""
from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from kvmesh.operator import crd
from kvmesh.operator import resources as R

from .examples import load_example

OWNER = R.Owner(name="smol", uid="0b6c2f4e-1111-2222-3333-444455556666")
K8S_VERSION = "1.32.0"


def _svc(spec: dict[str, Any] | None = None, name: str = "smol", ns: str = "team-a") -> crd.InferenceService:
    return crd.parse(name, ns, spec or {"model": {}})


def _full() -> crd.InferenceService:
    cr = load_example("full.yaml")
    return crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])


def _validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"].startswith("keda.sh/"):
        return  # not a built-in kind; checked field by field below
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


REMOTE = {"model": {"source": "uri", "uri": "s3://models/team/tiny-llama", "endpoint": "http://minio:9000",
                    "credentials": {"secretName": "s3-creds", "accessKeyIdKey": "access",
                                    "secretAccessKeyKey": "secret"},
                    "cache": {"hostPath": "/var/lib/kvmesh/models", "maxSize": "200G"}}}


@pytest.mark.parametrize("spec_name", ["minimal", "full", "hpa", "no-router", "cpu", "remote"])
def test_every_built_object_is_valid_kubernetes(spec_name: str) -> None:
    svc = {"minimal": _svc(), "full": _full(), "remote": _svc(REMOTE),
           "hpa": _svc({"model": {}, "autoscaling": {"enabled": True, "mode": "hpa"}}),
           "no-router": _svc({"model": {"source": "uri", "uri": "/opt/model"}, "router": {"enabled": False},
                              "ingress": {"enabled": True}}),
           "cpu": _svc({"model": {}, "gpu": {"count": 0}})}[spec_name]
    children = R.build_children(svc, OWNER, R.engine_replicas(svc, None))
    for obj in children:
        _validate(obj)
    keys = [R.child_key(c) for c in children]
    assert len(keys) == len(set(keys))
    assert set(keys) <= set(R.possible_children(svc))


def test_minimal_children_in_creation_order() -> None:
    svc = _svc()
    assert [R.child_key(c) for c in R.build_children(svc, OWNER, 1)] == [
        ("networking.k8s.io/v1", "NetworkPolicy", "smol-redis"),
        ("apps/v1", "Deployment", "smol-redis"), ("v1", "Service", "smol-redis"),
        ("v1", "ConfigMap", "smol-engine-config"), ("v1", "Service", "smol-engine"),
        ("apps/v1", "Deployment", "smol-engine"), ("apps/v1", "Deployment", "smol-router"),
        ("v1", "Service", "smol")]


def test_engine_deployment_minimal() -> None:
    dep = R.build_engine_deployment(_svc(), OWNER, 1)
    assert dep["metadata"]["labels"] == {
        "app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/instance": "smol",
        "app.kubernetes.io/component": "engine", "app.kubernetes.io/part-of": "kvmesh",
        "app.kubernetes.io/managed-by": "kvmesh-operator", "kvmesh.io/inference-service": "smol"}
    assert dep["metadata"]["ownerReferences"] == [{
        "apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService", "name": "smol", "uid": OWNER.uid,
        "controller": True, "blockOwnerDeletion": True}]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"] == {"matchLabels": {"kvmesh.io/inference-service": "smol",
                                                       "app.kubernetes.io/component": "engine"}}
    pod = dep["spec"]["template"]
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics",
        "kvmesh.io/config-hash": R.config_hash(_svc())}
    (c,) = pod["spec"]["containers"]
    # the engine settings come from the ConfigMap, mounted where --config reads it, never as args
    assert c["args"] == ["serve", "--config", "/etc/kvmesh/engine.json", "--host", "0.0.0.0", "--port", "8000",
                         "--pod-id", "$(POD_NAME)"]
    assert {"name": "config", "mountPath": "/etc/kvmesh", "readOnly": True} in c["volumeMounts"]
    assert {"name": "config", "configMap": {"name": "smol-engine-config"}} in pod["spec"]["volumes"]
    assert c["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "KVMESH_SERVICE", "value": "smol"},
        # the managed Redis' generated password
        {"name": "KVMESH_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "smol-redis-auth",
                                                                         "key": "password"}}},
        {"name": "HF_HOME", "value": "/home/kvmesh/.cache/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": "/home/kvmesh/.cache/triton"}]
    # the Triton cache lives on the writable model-cache emptyDir (the root filesystem is read-only)
    assert {"name": "model-cache", "mountPath": "/home/kvmesh/.cache"} in c["volumeMounts"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["spec"]["volumes"]
    assert c["resources"] == {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1800
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001
    assert pod["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert "nodeSelector" not in pod["spec"] and "tolerations" not in pod["spec"]


def test_a_remote_model_is_fetched_by_an_init_container_into_the_node_cache() -> None:
    svc = _svc(REMOTE)
    pod = R.build_engine_deployment(svc, OWNER, 1)["spec"]["template"]["spec"]
    fetch_env = [
        {"name": "KVMESH_MODEL_CACHE_DIR", "value": "/var/cache/kvmesh/models"},
        {"name": "HF_HUB_CACHE", "value": "/var/cache/kvmesh/models/hub"},
        {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"},
        {"name": "KVMESH_MODEL_CACHE_MAX_SIZE", "value": "200G"},
        *({"name": var, "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": key, "optional": True}}}
          for var, key in (("AWS_ACCESS_KEY_ID", "access"), ("AWS_SECRET_ACCESS_KEY", "secret"),
                           ("AWS_SESSION_TOKEN", "AWS_SESSION_TOKEN"), ("HF_TOKEN", "HF_TOKEN")))]
    assert pod["initContainers"] == [{
        "name": "fetch-model", "image": svc.image, "imagePullPolicy": svc.image_pull_policy,
        # the summary in the termination message: status.modelStorage (size, fetch time)
        "args": ["fetch", "s3://models/team/tiny-llama", "--summary-file", "/dev/termination-log"],
        "env": fetch_env,
        "volumeMounts": [{"name": "fetched-models", "mountPath": "/var/cache/kvmesh/models"},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError", "securityContext": R.CONTAINER_SECURITY}]
    assert {"name": "fetched-models", "hostPath": {"path": "/var/lib/kvmesh/models", "type": "DirectoryOrCreate"}} \
        in pod["volumes"]
    (engine,) = pod["containers"]
    # the engine resolves the same URI through the same cache: the init container's copy
    assert engine["env"][-len(fetch_env):] == fetch_env
    assert {"name": "fetched-models", "mountPath": "/var/cache/kvmesh/models"} in engine["volumeMounts"]
    assert R.engine_config(svc)["model"] == "s3://models/team/tiny-llama"
    router = R.build_router_deployment(svc, OWNER)["spec"]["template"]["spec"]
    assert R.router_args(svc)[R.router_args(svc).index("--model") + 1] == "s3://models/team/tiny-llama"
    assert router["containers"][0]["env"][-len(fetch_env):] == fetch_env
    # a model inside the image, or on a claim, needs no fetch
    assert "initContainers" not in R.build_engine_deployment(_svc(), OWNER, 1)["spec"]["template"]["spec"]
    claim = _svc({"model": {"source": "uri", "uri": "hf://org/m@v1", "cache": {"claimName": "models"}}})
    claim_pod = R.build_engine_deployment(claim, OWNER, 1)["spec"]["template"]["spec"]
    assert {"name": "fetched-models", "persistentVolumeClaim": {"claimName": "models"}} in claim_pod["volumes"]
    assert claim_pod["initContainers"][0]["args"] == ["fetch", "hf://org/m@v1", "--summary-file",
                                                      "/dev/termination-log"]


def test_engine_deployment_full() -> None:
    svc = _full()
    dep = R.build_engine_deployment(svc, OWNER, None)
    assert "replicas" not in dep["spec"]  # KEDA owns the count
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["serve", "--config", "/etc/kvmesh/engine.json", "--host", "0.0.0.0", "--port", "8000",
                         "--pod-id", "$(POD_NAME)",
                         "--otlp-traces-endpoint", "http://otel-collector.observability:4317"]
    assert json.loads(R.build_config_map(svc, OWNER)["data"]["engine.json"]) == {
        "model": "/models/Llama-3.1-8B-Instruct", "served_model_name": "llama-3.1-8b-instruct",
        "tokenizer": "/models/tokenizers/Llama-3.1-8B-Instruct", "max_num_seqs": 128,
        "max_num_batched_tokens": 16384, "block_size": 32, "kv_cache_memory_fraction": 0.85,
        "scheduling_policy": "priority", "enable_prefix_caching": False, "preemption_mode": "swap",
        "redis_url": "rediss://redis.infra.svc:6380/2", "tensor_parallel_size": 2, "cache_salt_from": "api-key"}
    assert c["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 2},
                              "limits": {"memory": "96Gi", "nvidia.com/gpu": 2}}
    assert [e["name"] for e in c["env"]] == [
        "POD_NAME", "POD_NAMESPACE", "POD_IP", "KVMESH_SERVICE", "KVMESH_REDIS_PASSWORD", "KVMESH_REDIS_CA_FILE",
        "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "HF_HOME", "TRITON_CACHE_DIR",
        "KVMESH_API_KEY", "KVMESH_ADMIN_API_KEY", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["KVMESH_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert env["KVMESH_API_KEY"] == {"secretKeyRef": {"name": "kvmesh-api-key", "key": "api-key"}}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    assert env["OTEL_SERVICE_NAME"] == "llama-engine"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.namespace.name=llm,kvmesh.inference_service=llama"
    assert env["TRITON_CACHE_DIR"] == "/home/kvmesh/.cache/triton"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}} \
        in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_router_and_front_service() -> None:
    svc = _full()
    router = R.build_router_deployment(svc, OWNER)
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "router", "--host", "0.0.0.0", "--port", "8080", "--redis-url", "rediss://redis.infra.svc:6380/2",
        "--discover-headless-service", "llama-engine", "--strategy", "kv-aware",
        "--served-model-name", "llama-3.1-8b-instruct", "--block-size", "32",
        "--model", "/models/Llama-3.1-8B-Instruct", "--tokenizer", "/models/tokenizers/Llama-3.1-8B-Instruct",
        "--cache-salt-from", "api-key"]
    # the router has no tracing: no OTEL_* variables even though spec.tracing is set
    router_env = router["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["name"] for e in router_env] == [
        "POD_NAME", "POD_NAMESPACE", "POD_IP", "KVMESH_SERVICE", "KVMESH_REDIS_PASSWORD", "KVMESH_REDIS_CA_FILE",
        "KVMESH_API_KEY"]
    pod_spec = router["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {
        "claimName": svc.model.pvc_claim, "readOnly": True}} in pod_spec["volumes"]
    assert pod_spec["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert R.router_args(_svc()) == [
        "router", "--host", "0.0.0.0", "--port", "8080", "--redis-url", "redis://smol-redis.team-a.svc:6379/0",
        "--discover-headless-service", "smol-engine", "--strategy", "kv-aware", "--served-model-name", "smol",
        "--block-size", "16"]
    front = R.build_front_service(svc, OWNER)
    assert front["spec"]["selector"] == {"kvmesh.io/inference-service": "llama", "app.kubernetes.io/component": "router"}
    assert front["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    direct = R.build_front_service(_svc({"model": {}, "router": {"enabled": False}}), OWNER)
    assert direct["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    assert direct["spec"]["ports"][0]["targetPort"] == 8000
    headless = R.build_engine_service(svc, OWNER)
    assert headless["spec"]["clusterIP"] == "None"


def test_router_gets_the_api_key_the_engines_check() -> None:
    router_env = R.build_router_deployment(_full(), OWNER)["spec"]["template"]["spec"]["containers"][0]["env"]
    engine_env = R.build_engine_deployment(_full(), OWNER, 1)["spec"]["template"]["spec"]["containers"][0]["env"]
    key = {"name": "KVMESH_API_KEY", "valueFrom": {"secretKeyRef": {"name": "kvmesh-api-key", "key": "api-key"}}}
    assert key in router_env and key in engine_env
    no_key = R.build_router_deployment(_svc(), OWNER)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "KVMESH_API_KEY" not in [e["name"] for e in no_key]


def test_ingress_and_url() -> None:
    svc = _full()
    ing = R.build_ingress(svc, OWNER)
    assert ing["spec"] == {
        "ingressClassName": "nginx",
        "rules": [{"host": "llama.example.com", "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
            "service": {"name": "llama", "port": {"name": "http"}}}}]}}],
        "tls": [{"hosts": ["llama.example.com"], "secretName": "llama-tls"}]}
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ing["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert R.service_url(svc) == "https://llama.example.com"
    assert R.service_url(_svc()) == "http://smol.team-a.svc"


def test_autoscaling_objects() -> None:
    hpa_svc = _svc({"model": {}, "autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 6,
                                                  "targetWaitingRequests": 5, "cooldownSeconds": 90}})
    hpa = R.build_hpa(hpa_svc, OWNER)
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smol-engine"},
        "minReplicas": 2, "maxReplicas": 6,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": "kvmesh_num_requests_waiting"},
                                              "target": {"type": "AverageValue", "averageValue": "5"}}}],
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 90}, "scaleUp": {"stabilizationWindowSeconds": 0}}}
    assert R.engine_replicas(hpa_svc, None) is None
    so = R.build_scaled_object(_full(), OWNER)
    assert so["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-engine"},
        "minReplicaCount": 2, "maxReplicaCount": 8,
        # cooldownSeconds is the scale-down window of the HPA KEDA manages (cooldownPeriod would only
        # apply when scaling to zero)
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 120}, "scaleUp": {"stabilizationWindowSeconds": 0}}}},
        "pollingInterval": 15,
        "triggers": [{"type": "prometheus", "metadata": {
            "serverAddress": "http://prometheus.monitoring:9090",
            "query": 'sum(vllm:num_requests_waiting{namespace="llm",model_name="llama-3.1-8b-instruct"})',
            "threshold": "6"}}]}


def test_engine_replicas_policy() -> None:
    assert R.engine_replicas(_svc({"model": {}, "replicas": 3}), 7) == 3  # no autoscaling: the spec wins
    auto = _svc({"model": {}, "replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}})
    assert R.engine_replicas(auto, None) == 2  # clamped to min
    assert R.engine_replicas(auto, 4) == 4
    assert R.engine_replicas(auto, 9) == 5


def test_config_map_and_hash_follow_engine_settings() -> None:
    cm = R.build_config_map(_svc(), OWNER)
    assert json.loads(cm["data"]["engine.json"]) == {
        "model": None, "served_model_name": "smol", "tokenizer": None, "max_num_seqs": 256,
        "max_num_batched_tokens": 8192, "block_size": 16, "kv_cache_memory_fraction": 0.9,
        "scheduling_policy": "fcfs", "enable_prefix_caching": True, "preemption_mode": "recompute",
        "redis_url": "redis://smol-redis.team-a.svc:6379/0"}
    other = _svc({"model": {"source": "uri", "uri": "/opt/models/SmolLM2-360M"}})
    assert R.config_hash(other) != R.config_hash(_svc())
    assert R.config_hash(_svc()) == R.config_hash(_svc())
    # the pod template carries the hash, so a settings change (now only in the ConfigMap) rolls the pods
    tmpl = R.build_engine_deployment(other, OWNER, 1)["spec"]["template"]
    assert tmpl["metadata"]["annotations"]["kvmesh.io/config-hash"] == R.config_hash(other)
    assert tmpl["spec"] == R.build_engine_deployment(_svc(), OWNER, 1)["spec"]["template"]["spec"]


def test_redis_is_non_root_and_ephemeral() -> None:
    dep = R.build_redis_deployment(_svc(), OWNER)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 999
    assert pod["containers"][0]["image"] == "redis:7.4.1-alpine"
    assert pod["containers"][0]["args"][:5] == ["/etc/redis/redis.conf", "--save", "", "--appendonly", "no"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}


def test_managed_redis_requires_the_generated_password() -> None:
    secret = R.build_redis_secret(_svc(), OWNER, "pw-123")
    _validate(secret)
    assert secret["metadata"]["name"] == "smol-redis-auth"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert secret["stringData"] == {"password": "pw-123", "redis.conf": "requirepass pw-123\n"}
    pod = R.build_redis_deployment(_svc(), OWNER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][0] == "/etc/redis/redis.conf"  # read as the config file: the password is in no arg
    assert "pw-123" not in json.dumps(pod)
    assert {"name": "auth", "mountPath": "/etc/redis", "readOnly": True} in c["volumeMounts"]
    assert {"name": "auth", "secret": {"secretName": "smol-redis-auth", "defaultMode": 0o440,
                                       "items": [{"key": "redis.conf", "path": "redis.conf"}]}} in pod["volumes"]
    # engines and router authenticate with the same Secret
    for dep in (R.build_engine_deployment(_svc(), OWNER, 1), R.build_router_deployment(_svc(), OWNER)):
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "KVMESH_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": "smol-redis-auth", "key": "password"}}} in env


def test_redis_network_policy_admits_only_the_services_engines_router_and_operator() -> None:
    pol = R.build_redis_network_policy(_svc(), OWNER, "kvmesh-system")
    _validate(pol)
    assert pol["spec"] == {
        "podSelector": {"matchLabels": {"kvmesh.io/inference-service": "smol", "app.kubernetes.io/component": "redis"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [
            {"podSelector": {"matchLabels": {"kvmesh.io/inference-service": "smol",
                                             "app.kubernetes.io/component": "engine"}}},
            {"podSelector": {"matchLabels": {"kvmesh.io/inference-service": "smol",
                                             "app.kubernetes.io/component": "router"}}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvmesh-system"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvmesh",
                                             "app.kubernetes.io/component": "operator"}}}],
            "ports": [{"protocol": "TCP", "port": 6379}]}]}
    assert len(R.build_redis_network_policy(_svc(), OWNER, None)["spec"]["ingress"][0]["from"]) == 2
    external = _svc({"model": {}, "redis": {"url": "redis://r:6379/0"}})
    assert "NetworkPolicy" not in [c["kind"] for c in R.build_children(external, OWNER, 1)]


@pytest.mark.parametrize("source", ["configMap", "secret"])
def test_external_redis_ca_bundle_is_mounted_for_engine_and_router(source: str) -> None:
    svc = _svc({"model": {}, "redis": {"url": "rediss://redis.infra:6380/0", "passwordSecret": {"name": "auth"},
                                       "caBundle": {source: "redis-ca", "key": "bundle.pem"}}})
    items = [{"key": "bundle.pem", "path": "ca.crt"}]
    volume = ({"name": "redis-ca", "configMap": {"name": "redis-ca", "items": items}} if source == "configMap"
              else {"name": "redis-ca", "secret": {"secretName": "redis-ca", "items": items}})
    for dep in (R.build_engine_deployment(svc, OWNER, 1), R.build_router_deployment(svc, OWNER)):
        _validate(dep)
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert {"name": "KVMESH_REDIS_CA_FILE", "value": "/etc/kvmesh-redis-ca/ca.crt"} in c["env"]
        assert {"name": "redis-ca", "mountPath": "/etc/kvmesh-redis-ca", "readOnly": True} in c["volumeMounts"]
        assert volume in pod["volumes"]
    assert "KVMESH_REDIS_CA_FILE" not in json.dumps(R.build_engine_deployment(_svc(), OWNER, 1))


def test_tracing_protocol_follows_the_spec() -> None:
    svc = _svc({"model": {}, "tracing": {"otlpEndpoint": "http://otel:4318", "protocol": "http/protobuf",
                                         "samplingRatio": 1}})
    assert R.tracing_env(svc) == [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4318"},
        {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "http/protobuf"},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "1"},
        {"name": "OTEL_SERVICE_NAME", "value": "smol-engine"},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "k8s.namespace.name=team-a,kvmesh.inference_service=smol"}]
    assert R.tracing_env(_svc()) == []


def test_optional_kinds_name_their_rbac_value() -> None:
    assert R.OPTIONAL_KINDS == {"HorizontalPodAutoscaler": "rbac.hpa", "ScaledObject": "rbac.keda",
                                "InferencePool": "rbac.inferencePool", "ServiceAccount": "rbac.inferencePool",
                                "Role": "rbac.inferencePool", "RoleBinding": "rbac.inferencePool"}
