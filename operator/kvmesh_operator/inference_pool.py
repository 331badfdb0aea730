"""PURE builders of router.mode inference-pool: a Gateway API InferencePool over the engine pods, and
llm-d's endpoint picker (EPP) with its configuration, identity and rights, instead of kvmesh's router.

The picker's precise-prefix-cache scorer subscribes to every ready engine pod's ZMQ KV-event
publisher (pod discovery, port `runtimes.KV_EVENTS_PORT`, topic `kv@<pod IP>:<port>@<model>`) and
keys blocks by its own hash of the token ids the events carry, so only the block size must match
the engines'. It tokenizes prompts itself, with the model's tokenizer read from the model PVC.
"""
from __future__ import annotations

from typing import Any

import yaml

from . import resources as R
from . import runtimes as RT
from .crd import InferenceService

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
EPP_CONFIG_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
EPP_GRPC_PORT = 9002  # ext-proc, what the gateway calls
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_DIR = "/config"
EPP_CONFIG_KEY = "epp-config.yaml"


def epp_name(svc: InferenceService) -> str:
    return f"{svc.name}-epp"


def epp_config_name(svc: InferenceService) -> str:
    return f"{svc.name}-epp-config"


def tokenizer_file(svc: InferenceService) -> str:
    """The tokenizer.json the picker reads, on the model PVC mounted at /models (CEL requires pvc)."""
    directory = svc.model.tokenizer or R.model_path(svc)
    return f"{directory.rstrip('/')}/tokenizer.json"


def build_inference_pool(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": POOL_API_VERSION, "kind": "InferencePool",
            "metadata": R.object_meta(svc, owner, svc.name, "engine"),
            "spec": {"selector": {"matchLabels": R.selector(svc, "engine")},
                     "targetPorts": [{"number": R.ENGINE_PORT}],
                     "endpointPickerRef": {"group": "", "kind": "Service", "name": epp_name(svc),
                                           "port": {"number": EPP_GRPC_PORT},
                                           "failureMode": svc.router.inference_pool.failure_mode}}}


def epp_config(svc: InferenceService) -> dict[str, Any]:
    """llm-d's EndpointPickerConfig: precise prefix-cache scoring from the engines' KV events, plus load."""
    served = svc.model.served_name
    scorer = {
        "tokenProcessorConfig": {"blockSize": svc.engine.block_size, "hashSeed": RT.HASH_SEED},
        "kvEventsConfig": {"topicFilter": RT.LLMD_TOPIC_FILTER, "concurrency": 4, "discoverPods": True,
                           "podDiscoveryConfig": {"podLabelSelector": R.selector_string(svc),
                                                  "podNamespace": svc.namespace,
                                                  "socketPort": RT.KV_EVENTS_PORT}},
        "indexerConfig": {"tokenizersPoolConfig": {"modelName": served,
                                                   "local": {"modelTokenizerMap": {served: tokenizer_file(svc)}}},
                          "kvBlockIndexConfig": {"enableMetrics": True}},
    }
    return {"apiVersion": EPP_CONFIG_API_VERSION, "kind": "EndpointPickerConfig",
            "plugins": [{"type": "tokenizer", "parameters": {"modelName": served}},
                        {"type": "endpoint-notification-source"}, {"type": "metrics-data-source"},
                        {"type": "core-metrics-extractor"}, {"type": "single-profile-handler"},
                        {"type": "precise-prefix-cache-scorer", "parameters": scorer},
                        {"type": "kv-cache-utilization-scorer"}, {"type": "queue-scorer"},
                        {"type": "max-score-picker"}],
            "dataLayer": {"sources": [
                {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]},
                {"pluginRef": "endpoint-notification-source",
                 "extractors": [{"pluginRef": "precise-prefix-cache-scorer"}]}]},
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "tokenizer"}, {"pluginRef": "precise-prefix-cache-scorer", "weight": 2.0},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 1.0},
                {"pluginRef": "queue-scorer", "weight": 1.0}, {"pluginRef": "max-score-picker"}]}]}


def build_epp_config_map(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": R.object_meta(svc, owner, epp_config_name(svc), "epp"),
            "data": {EPP_CONFIG_KEY: yaml.safe_dump(epp_config(svc), sort_keys=False)}}


def epp_args(svc: InferenceService) -> list[str]:
    args = ["--pool-name", svc.name, "--pool-namespace", svc.namespace, "--pool-group", POOL_GROUP,
            "--config-file", f"{EPP_CONFIG_DIR}/{EPP_CONFIG_KEY}", "--grpc-port", str(EPP_GRPC_PORT),
            "--grpc-health-port", str(EPP_HEALTH_PORT), "--metrics-port", str(EPP_METRICS_PORT),
            "--zap-encoder", "json"]
    if svc.router.inference_pool.replicas > 1:
        args.append("--ha-enable-leader-election")
    return args


def build_epp_deployment(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    pool = svc.router.inference_pool
    health = "inference-extension" if pool.replicas == 1 else None
    container = {
        "name": "epp", "image": pool.endpoint_picker_image, "imagePullPolicy": svc.image_pull_policy,
        "args": epp_args(svc),
        "env": [R.field_env("NAMESPACE", "metadata.namespace"), R.field_env("POD_NAME", "metadata.name")],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": health or "liveness"},
                          "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": health or "readiness"}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": R.CONTAINER_SECURITY,
        "volumeMounts": [{"name": "config", "mountPath": EPP_CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "model", "mountPath": R.MODELS_DIR, "readOnly": True}],
    }
    volumes = [{"name": "config", "configMap": {"name": epp_config_name(svc)}}, {"name": "tmp", "emptyDir": {}},
               {"name": "model", "persistentVolumeClaim": {"claimName": svc.model.pvc_claim, "readOnly": True}}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": R.object_meta(svc, owner, epp_name(svc), "epp"),
            "spec": {"replicas": pool.replicas,
                     # NOTE: one active picker holds the prefix index; the old one goes before the new starts.
                     "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": R.selector(svc, "epp")},
                     "template": {"metadata": {"labels": R.labels(svc, "epp"), "annotations": {
                         "prometheus.io/scrape": "true", "prometheus.io/port": str(EPP_METRICS_PORT),
                         "prometheus.io/path": "/metrics"}},
                         "spec": {"serviceAccountName": epp_name(svc), "securityContext": R.POD_SECURITY,
                                  "terminationGracePeriodSeconds": 130, "containers": [container],
                                  "volumes": volumes}}}}


def build_epp_service(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": R.object_meta(svc, owner, epp_name(svc), "epp"),
            "spec": {"type": "ClusterIP", "selector": R.selector(svc, "epp"),
                     "ports": [{"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": "grpc",
                                "protocol": "TCP", "appProtocol": "http2"},
                               {"name": "http-metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def build_epp_service_account(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": R.object_meta(svc, owner, epp_name(svc), "epp")}


# NOTE: what the picker reads, in its own namespace only: the engine pods (endpoints and KV-event
# subscribers), its InferencePool and the pool's objectives. The operator can grant only rights it
# holds itself (RBAC escalation check): the chart's rbac.inferencePool gives it these.
EPP_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
              "verbs": ["get", "list", "watch"]}]


def build_epp_role(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": R.object_meta(svc, owner, epp_name(svc), "epp"), "rules": [dict(r) for r in EPP_RULES]}


def build_epp_role_binding(svc: InferenceService, owner: R.Owner) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": R.object_meta(svc, owner, epp_name(svc), "epp"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": epp_name(svc)},
            "subjects": [{"kind": "ServiceAccount", "name": epp_name(svc), "namespace": svc.namespace}]}


def build_pool_children(svc: InferenceService, owner: R.Owner) -> list[dict[str, Any]]:
    """In creation order: identity and rights, configuration, the picker, then the pool naming it."""
    return [build_epp_service_account(svc, owner), build_epp_role(svc, owner), build_epp_role_binding(svc, owner),
            build_epp_config_map(svc, owner), build_epp_deployment(svc, owner), build_epp_service(svc, owner),
            build_inference_pool(svc, owner)]


def possible_pool_children(svc: InferenceService) -> list[R.ChildKey]:
    name = epp_name(svc)
    return [("v1", "ServiceAccount", name), ("rbac.authorization.k8s.io/v1", "Role", name),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", name), ("v1", "ConfigMap", epp_config_name(svc)),
            ("apps/v1", "Deployment", name), ("v1", "Service", name),
            (POOL_API_VERSION, "InferencePool", svc.name)]
