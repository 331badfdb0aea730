"""PURE builders: one parsed InferenceService → the Kubernetes objects that serve it.

No I/O, no clock, no cluster: every function returns plain dicts, so tests can compare them
exactly and validate them against the Kubernetes OpenAPI schemas.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from . import API_VERSION, KIND
from . import model_fetch as MF
from . import runtimes as RT
from .crd import InferenceService, SecretRef
from .openmp_wait import openmp_env

ENGINE_PORT = RT.ENGINE_PORT
ROUTER_PORT = 8080
REDIS_PORT = 6379
RUN_AS_USER = 10001  # the image's `kvmesh` user
REDIS_RUN_AS_USER = 999  # the `redis` user of the official redis image
CACHE_DIR = "/home/kvmesh/.cache"  # an emptyDir in engine and router pods
TRITON_CACHE_DIR = f"{CACHE_DIR}/triton"
MODELS_DIR = "/models"
CONFIG_DIR = "/etc/kvmesh"
CONFIG_KEY = "engine.json"  # the ConfigMap key, a file in CONFIG_DIR
CONFIG_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"  # what `kvmesh serve --config` reads
MANAGED_BY = "kvmesh-operator"
OWNER_LABEL = "kvmesh.io/inference-service"
CONFIG_HASH_ANNOTATION = "kvmesh.io/config-hash"
# NOTE: a hash of the Redis password Secret's data on the engine and router pod templates: a rotated
# (or deleted, then regenerated) password rolls the pods, which read it from env at start only.
REDIS_AUTH_ANNOTATION = "kvmesh.io/redis-auth-checksum"
WAITING_METRIC = "kvmesh:num_requests_waiting"
PENDING_METRIC = "kvmesh_router_pending_requests"  # the router's held requests (scale to zero)
REDIS_PASSWORD_KEY = "password"  # key of the generated Secret the clients read (KVMESH_REDIS_PASSWORD)
REDIS_CONF_KEY = "redis.conf"  # key of the same Secret the managed Redis reads (`requirepass …`)
REDIS_CONF_DIR = "/etc/redis"
REDIS_CA_DIR = "/etc/kvmesh-redis-ca"
REDIS_CA_FILE = f"{REDIS_CA_DIR}/ca.crt"  # KVMESH_REDIS_CA_FILE in engine and router pods
# The operator's pods, as the chart labels them (the managed Redis' NetworkPolicy admits them).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/component": "operator"}


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService object that children point back to (garbage collection)."""
    name: str
    uid: str


# ---- names and labels -----------------------------------------------------------------------------
def engine_name(svc: InferenceService) -> str:
    return f"{svc.name}-engine"


def router_name(svc: InferenceService) -> str:
    return f"{svc.name}-router"


def redis_name(svc: InferenceService) -> str:
    return f"{svc.name}-redis"


def redis_secret_name(svc: InferenceService) -> str:
    return f"{svc.name}-redis-auth"


def redis_password_ref(svc: InferenceService) -> SecretRef | None:
    """Where the Redis password lives: the external Redis' Secret, or the generated one of the managed Redis."""
    if svc.redis.managed:
        return SecretRef(name=redis_secret_name(svc), key=REDIS_PASSWORD_KEY)
    return svc.redis.password_secret


def config_name(svc: InferenceService) -> str:
    return f"{svc.name}-engine-config"


def selector(svc: InferenceService, component: str) -> dict[str, str]:
    # NOTE: selectors are immutable on Deployments: only stable labels, never the image or model.
    return {OWNER_LABEL: svc.name, "app.kubernetes.io/component": component}


def labels(svc: InferenceService, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvmesh",
        "app.kubernetes.io/instance": svc.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvmesh",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: svc.name,
    }


def selector_string(svc: InferenceService, component: str = "engine") -> str:
    """A component's pods' selector as a label-selector string (the engines': the scale subresource's
    status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector(svc, component).items()))


def needs_redis(svc: InferenceService) -> bool:
    """Is there a prefix index to run or use: kvmesh engines publish to it, kvmesh's router reads it."""
    return svc.engine.runtime == "kvmesh" or svc.router.builtin


def redis_url(svc: InferenceService) -> str:
    if svc.redis.url is not None:
        return svc.redis.url
    return f"redis://{redis_name(svc)}.{svc.namespace}.svc:{REDIS_PORT}/0"


def service_url(svc: InferenceService) -> str:
    """Where clients reach the API: the ingress host, else the in-cluster Service."""
    if svc.ingress.enabled and svc.ingress.host:
        scheme = "https" if svc.ingress.tls_secret else "http"
        return f"{scheme}://{svc.ingress.host}"
    return f"http://{svc.name}.{svc.namespace}.svc"


def object_meta(svc: InferenceService, owner: Owner, name: str, component: str,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name, "namespace": svc.namespace, "labels": labels(svc, component),
        "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
                             "controller": True, "blockOwnerDeletion": True}],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                 "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _pod_env() -> list[dict[str, Any]]:
    return [field_env("POD_NAME", "metadata.name"), field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IP", "status.podIP")]


def _common_env(svc: InferenceService) -> list[dict[str, Any]]:
    # NOTE: POD_IP is the address engines advertise to the router; KVMESH_SERVICE scopes the
    # Redis keys to kvmesh:{namespace}/{name}:, the prefix the finalizer deletes.
    env = _pod_env() + [{"name": "KVMESH_SERVICE", "value": svc.name}]
    if (ref := redis_password_ref(svc)) is not None:
        env.append({"name": "KVMESH_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if svc.redis.ca_bundle is not None:
        env.append({"name": "KVMESH_REDIS_CA_FILE", "value": REDIS_CA_FILE})
    return env


def _redis_ca_volume(svc: InferenceService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(mounts, volumes) of the external Redis' CA bundle, at REDIS_CA_FILE; empty without one."""
    ca = svc.redis.ca_bundle
    if ca is None:
        return [], []
    items = [{"key": ca.key, "path": "ca.crt"}]
    source = ({"configMap": {"name": ca.name, "items": items}} if ca.kind == "ConfigMap"
              else {"secret": {"secretName": ca.name, "items": items}})
    return [{"name": "redis-ca", "mountPath": REDIS_CA_DIR, "readOnly": True}], [{"name": "redis-ca", **source}]


def _secret_env(name: str, ref: SecretRef | None) -> list[dict[str, Any]]:
    return [] if ref is None else [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _api_key_env(svc: InferenceService, variable: str = "KVMESH_API_KEY") -> list[dict[str, Any]]:
    """The API key (KVMESH_API_KEY for `kvmesh serve` and `kvmesh router`, VLLM_API_KEY for `vllm serve`)."""
    return _secret_env(variable, svc.api_key_secret)


def tracing_env(svc: InferenceService) -> list[dict[str, Any]]:
    """OpenTelemetry settings of the engines (the router has no tracing); empty when tracing is off."""
    t = svc.tracing
    if t.otlp_endpoint is None:
        return []
    # NOTE: the engines' exporter defaults to http/protobuf; the protocol must match the endpoint's
    # port (4317 gRPC, 4318 HTTP), so it is always set explicitly.
    return [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": t.otlp_endpoint},
            {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": t.protocol},
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": str(t.sampling_ratio)},
            {"name": "OTEL_SERVICE_NAME", "value": engine_name(svc)},
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": f"k8s.namespace.name={svc.namespace},kvmesh.inference_service={svc.name}"}]


# ---- engine -----------------------------------------------------------------------------------------
def engine_config(svc: InferenceService) -> dict[str, Any]:
    """The engine settings, as written to the ConfigMap (and hashed into the pod template).

    The engine reads them with `kvmesh serve --config /etc/kvmesh/engine.json`: every key is a
    `kvmesh serve` flag name (underscores for dashes) and every value has that flag's type, so the
    server's --config loader accepts the file as is; null means the flag's default (the built-in
    model, the model's own tokenizer).
    """
    e = svc.engine
    config: dict[str, Any] = {
        "model": model_path(svc) or None, "served_model_name": svc.model.served_name,
        "tokenizer": svc.model.tokenizer,
        "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
        "block_size": e.block_size, "kv_cache_memory_fraction": e.kv_cache_memory_fraction,
        "scheduling_policy": e.scheduling_policy, "enable_prefix_caching": e.enable_prefix_caching,
        "preemption_mode": e.preemption_mode, "redis_url": redis_url(svc),
    }
    # NOTE: only when they differ from the flags' defaults, so that specs without them keep their
    # config hash (no rollout of every engine on an operator upgrade).
    if e.tensor_parallel_size != 1:
        config["tensor_parallel_size"] = e.tensor_parallel_size
    if e.kv_cache_dtype != "auto":
        config["kv_cache_dtype"] = e.kv_cache_dtype
    if svc.router.cache_salt_from != "none":
        config["cache_salt_from"] = svc.router.cache_salt_from
    # NOTE: the sizing flags only, never the adapters: those are loaded on the running pods
    # (lora_sync), so the list can change without a new config hash (a rollout)
    if svc.lora_enabled:
        config.update(enable_lora=True, max_loras=e.max_loras, max_lora_rank=e.max_lora_rank)
        if e.max_cpu_loras is not None:
            config["max_cpu_loras"] = e.max_cpu_loras
    if e.speculative_config is not None:
        # NOTE: a string: --speculative-config takes JSON text, in the file as on the command line
        config["speculative_config"] = e.speculative_config.to_json()
    return config


def config_hash(svc: InferenceService) -> str:
    return hashlib.sha256(json.dumps(engine_config(svc), sort_keys=True).encode()).hexdigest()[:16]


def model_path(svc: InferenceService) -> str:
    m = svc.model
    if m.source == "uri":
        return m.uri or ""
    if m.source == "pvc":
        return f"{MODELS_DIR}/{m.pvc_path}".rstrip("/") if m.pvc_path else MODELS_DIR
    return ""  # the built-in model


def engine_args(svc: InferenceService) -> list[str]:
    """`kvmesh serve` arguments (the image's entrypoint is `kvmesh`).

    The engine settings come from the mounted ConfigMap (`--config`), never repeated here; only
    what is not in it: the listen address, the pod's id and the tracing endpoint.
    """
    # NOTE: $(POD_NAME) is expanded by the kubelet from the container's env.
    args = ["serve", "--config", CONFIG_FILE, "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
            "--pod-id", "$(POD_NAME)"]
    if svc.tracing.otlp_endpoint is not None:
        args += ["--otlp-traces-endpoint", svc.tracing.otlp_endpoint]
    # NOTE: an argument, not a ConfigMap key: its topic names the pod ($(POD_IP)) for llm-d's picker.
    return args + RT.kv_events_args(svc)


def _engine_resources(svc: InferenceService) -> dict[str, Any]:
    requests = dict(svc.resources.get("requests", {}))
    limits = dict(svc.resources.get("limits", {}))
    if svc.gpu.count > 0:  # extended resources: request must equal limit
        requests[svc.gpu.resource_name] = svc.gpu.count
        limits[svc.gpu.resource_name] = svc.gpu.count
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _engine_container_run(svc: InferenceService) -> tuple[dict[str, Any], list[dict[str, Any]], str, str]:
    """(command/args, runtime env, readiness path, probe path) of the engine container."""
    if svc.engine.runtime == "vllm":
        # NOTE: vLLM's /health answers once the engine runs and needs no API key (/v1/models does).
        run = {"command": ["vllm", "serve"], "args": RT.vllm_args(svc, model_path(svc))}
        return run, RT.vllm_env() + _api_key_env(svc, "VLLM_API_KEY"), "/health", "/health"
    # NOTE: the root filesystem is read-only; Triton would write its kernel cache to ~/.triton.
    env = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
           {"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_DIR}]
    env += _api_key_env(svc) + _secret_env("KVMESH_ADMIN_API_KEY", svc.admin_api_key_secret)
    return {"args": engine_args(svc)}, env, "/ready", "/health"


def _engine_ports(svc: InferenceService) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if svc.kv_events:
        ports += [{"name": "kv-events", "containerPort": RT.KV_EVENTS_PORT, "protocol": "TCP"},
                  {"name": "kv-replay", "containerPort": RT.KV_REPLAY_PORT, "protocol": "TCP"}]
    return ports


def build_engine_deployment(svc: InferenceService, owner: Owner, replicas: int | None,
                            redis_auth: str | None = None) -> dict[str, Any]:
    """The GPU engine pods. `replicas=None` leaves the count to an HPA / KEDA; `redis_auth`: the
    checksum of the Redis password Secret (None: unknown, no annotation)."""
    run, runtime_env, ready_path, health_path = _engine_container_run(svc)
    vllm = svc.engine.runtime == "vllm"
    # NOTE: vLLM engines never talk to Redis (kvmesh's router reads their KV events over ZMQ).
    env = (_pod_env() if vllm else _common_env(svc)) + tracing_env(svc) + runtime_env
    env += RT.nccl_env(svc) + openmp_env(svc)
    mounts = [{"name": "model-cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
        # NOTE: NCCL (tensor parallelism) and torch's shared-memory tensors need more than the
        # runtime's default 64 MiB /dev/shm; memory-backed, so it counts against the pod's memory.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": svc.engine.shared_memory_size}}]
    if not vllm:
        mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config_name(svc)}})
    if svc.model.source == "pvc":
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": svc.model.pvc_claim,
                                                                   "readOnly": True}})
    # NOTE: with LoRA on, s3:// and hf:// adapters are fetched by the engine itself: the model
    # cache is there whatever the adapter list holds, so the list never changes the template
    if svc.model.remote or svc.lora_enabled:
        mounts.append(MF.cache_mount())
        volumes.append(MF.cache_volume(svc))
        env += MF.fetch_env(svc)
    if not vllm:
        ca_mounts, ca_volumes = _redis_ca_volume(svc)
        mounts, volumes = mounts + ca_mounts, volumes + ca_volumes
    container: dict[str, Any] = {
        "name": "engine", "image": svc.image, "imagePullPolicy": svc.image_pull_policy,
        **run, "env": env, "ports": _engine_ports(svc),
        # NOTE: loading weights can take minutes; the startup probe holds liveness off for 30 min.
        "startupProbe": {"httpGet": {"path": health_path, "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": 180, "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": {"path": ready_path, "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": {"path": health_path, "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6, "timeoutSeconds": 5},
        "securityContext": CONTAINER_SECURITY, "volumeMounts": mounts,
    }
    resources = _engine_resources(svc)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False, "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": 60, "containers": [container], "volumes": volumes,
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": selector(svc, "engine")}}],
    }
    if svc.model.remote:
        pod_spec["initContainers"] = [MF.fetch_init_container(svc, CONTAINER_SECURITY)]
    if svc.gpu.node_selector:
        pod_spec["nodeSelector"] = dict(svc.gpu.node_selector)
    if svc.gpu.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in svc.gpu.tolerations]
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(svc, "engine")},
        # NOTE: surge one pod and keep every old pod serving until its successor is ready, so a
        # model change rolls out without dropping capacity.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {"labels": labels(svc, "engine"), "annotations": _engine_annotations(svc, redis_auth)},
            "spec": pod_spec,
        },
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": object_meta(svc, owner, engine_name(svc), "engine"), "spec": spec}


def _engine_annotations(svc: InferenceService, redis_auth: str | None) -> dict[str, str]:
    out = {"prometheus.io/scrape": "true", "prometheus.io/port": str(ENGINE_PORT), "prometheus.io/path": "/metrics"}
    if svc.engine.runtime == "kvmesh":
        out[CONFIG_HASH_ANNOTATION] = config_hash(svc)
        if redis_auth is not None:
            out[REDIS_AUTH_ANNOTATION] = redis_auth
    return out


def build_engine_service(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    """Headless: the router discovers every ready engine pod from its DNS records (and their ZMQ ports)."""
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in _engine_ports(svc)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(svc, owner, engine_name(svc), "engine"),
            "spec": {"clusterIP": "None", "selector": selector(svc, "engine"), "publishNotReadyAddresses": False,
                     "ports": ports}}


def build_config_map(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(svc, owner, config_name(svc), "engine"),
            "data": {CONFIG_KEY: json.dumps(engine_config(svc), sort_keys=True, indent=2) + "\n"}}


# ---- router and the front Service ------------------------------------------------------------------
def router_args(svc: InferenceService) -> list[str]:
    """The router hashes prompts like the engines: same tokenizer, same block size, same served name."""
    # NOTE: prefix-block hashes only match the engines' with the same --block-size; the hash seed
    # is not configurable here, so engines and router both use their default ("kvmesh").
    # NOTE: disaggregated engines are found per role (P/D mode), colocated ones by one Service
    engines = (["--discover-headless-service", engine_name(svc)] if svc.disaggregation is None
               else _disagg_module().router_discovery_args(svc))
    args = ["router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--redis-url", redis_url(svc),
            *engines, "--strategy", svc.router.strategy,
            "--served-model-name", svc.model.served_name, "--block-size", str(svc.engine.block_size)]
    if model_path(svc):
        args += ["--model", model_path(svc)]
    if svc.model.tokenizer is not None:
        args += ["--tokenizer", svc.model.tokenizer]
    if svc.router.cache_salt_from != "none":
        args += ["--cache-salt-from", svc.router.cache_salt_from]
    if svc.router.expose_route_headers:
        args.append("--expose-route-headers")
    if scales_to_zero(svc):
        # NOTE: with no engine the router holds requests (and stays ready): they wake the engines
        args += ["--hold-timeout", str(svc.autoscaling.hold_timeout_seconds)]
    return args + RT.router_backend_args(svc)


def scales_to_zero(svc: InferenceService) -> bool:
    """Autoscaling may take the engines to zero (minReplicas 0; the CRD allows it in operator and keda modes)."""
    return svc.autoscaling.enabled and svc.autoscaling.min_replicas == 0


def build_router_deployment(svc: InferenceService, owner: Owner, redis_auth: str | None = None) -> dict[str, Any]:
    ready = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}
    alive = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6}
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    if svc.model.source == "pvc":
        # the router reads the model's tokenizer files (never its weights) from the same volume
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": svc.model.pvc_claim,
                                                                  "readOnly": True}})
    env = _common_env(svc) + _api_key_env(svc)
    if svc.model.remote:
        # NOTE: the router reads the tokenizer of an s3:// / hf:// model through the same cache
        # (on a shared hostPath or claim, the copy an engine fetched)
        mounts.append(MF.cache_mount())
        volumes.append(MF.cache_volume(svc))
        env += MF.fetch_env(svc)
    ca_mounts, ca_volumes = _redis_ca_volume(svc)
    mounts, volumes = mounts + ca_mounts, volumes + ca_volumes
    container = {
        "name": "router", "image": svc.router.image, "imagePullPolicy": svc.image_pull_policy,
        # NOTE: the router checks the same API key as the engines: the Service and Ingress point at it.
        "args": router_args(svc), "env": env,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": ready, "livenessProbe": alive,
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(svc, owner, router_name(svc), "router"),
            "spec": {"replicas": svc.router.replicas, "selector": {"matchLabels": selector(svc, "router")},
                     "template": {"metadata": {"labels": labels(svc, "router"), "annotations": {
                         "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                         "prometheus.io/path": "/metrics",
                         **({REDIS_AUTH_ANNOTATION: redis_auth} if redis_auth is not None else {})}},
                         "spec": {"automountServiceAccountToken": False, "securityContext": POD_SECURITY,
                                  "containers": [container], "volumes": volumes,
                                  "topologySpreadConstraints": [{
                                      "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                      "whenUnsatisfiable": "ScheduleAnyway",
                                      "labelSelector": {"matchLabels": selector(svc, "router")}}]}}}}


def build_front_service(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    """`<name>`: the stable entry point; kvmesh's router when it runs, else the engines themselves
    (with an InferencePool, clients come through a Gateway; this Service bypasses the picker)."""
    component, port = ("router", ROUTER_PORT) if svc.router.builtin else ("engine", ENGINE_PORT)
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(svc, owner, svc.name, component),
            "spec": {"type": "ClusterIP", "selector": selector(svc, component),
                     "ports": [{"name": "http", "port": 80, "targetPort": port, "protocol": "TCP"}]}}


# ---- redis -------------------------------------------------------------------------------------------
def build_redis_deployment(svc: InferenceService, owner: Owner, redis_auth: str | None = None) -> dict[str, Any]:
    probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 5}
    container = {
        "name": "redis", "image": svc.redis.image, "imagePullPolicy": svc.image_pull_policy,
        # NOTE: the prefix index is a cache that engines republish; no persistence, evict under pressure.
        # NOTE: the password comes from the generated Secret as a config file (`requirepass …`), so it is
        # never in the pod spec or the process' arguments; the image's entrypoint runs redis-server
        # with a first argument ending in .conf.
        "args": [f"{REDIS_CONF_DIR}/{REDIS_CONF_KEY}", "--save", "", "--appendonly", "no", "--protected-mode", "no",
                 "--maxmemory", "384mb", "--maxmemory-policy", "allkeys-lru"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "auth", "mountPath": REDIS_CONF_DIR, "readOnly": True}],
    }
    security = {**POD_SECURITY, "runAsUser": REDIS_RUN_AS_USER, "runAsGroup": REDIS_RUN_AS_USER,
                "fsGroup": REDIS_RUN_AS_USER}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(svc, owner, redis_name(svc), "redis"),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": selector(svc, "redis")},
                     "template": {"metadata": {"labels": labels(svc, "redis"), **(
                                      {"annotations": {REDIS_AUTH_ANNOTATION: redis_auth}} if redis_auth else {})},
                                  "spec": {"automountServiceAccountToken": False, "securityContext": security,
                                           "containers": [container],
                                           "volumes": [{"name": "data", "emptyDir": {}}, {
                                               "name": "auth", "secret": {
                                                   "secretName": redis_secret_name(svc), "defaultMode": 0o440,
                                                   "items": [{"key": REDIS_CONF_KEY, "path": REDIS_CONF_KEY}]}}]}}}}


def build_redis_secret(svc: InferenceService, owner: Owner, password: str) -> dict[str, Any]:
    """The managed Redis' password (generated once by the caller, never rotated by a reconcile)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_meta(svc, owner, redis_secret_name(svc), "redis"),
            "stringData": {REDIS_PASSWORD_KEY: password, REDIS_CONF_KEY: f"requirepass {password}\n"}}


def build_redis_network_policy(svc: InferenceService, owner: Owner, operator_namespace: str | None
                               ) -> dict[str, Any]:
    """Only this service's engines and router (and the operator's pods) may reach its Redis."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": selector(svc, "engine")}},
                                   {"podSelector": {"matchLabels": selector(svc, "router")}}]
    if operator_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                      "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(svc, owner, redis_name(svc), "redis"),
            "spec": {"podSelector": {"matchLabels": selector(svc, "redis")}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]}}


def build_redis_service(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(svc, owner, redis_name(svc), "redis"),
            "spec": {"type": "ClusterIP", "selector": selector(svc, "redis"),
                     "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}}


# ---- ingress -------------------------------------------------------------------------------------------
def build_ingress(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    ing = svc.ingress
    # NOTE: token streaming (SSE) must not be buffered, and long generations outlive the default 60 s.
    annotations = {"nginx.ingress.kubernetes.io/proxy-buffering": "off",
                   "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
                   "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600", **ing.annotations}
    rule: dict[str, Any] = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
        "service": {"name": svc.name, "port": {"name": "http"}}}}]}}
    if ing.host:
        rule = {"host": ing.host, **rule}
    spec: dict[str, Any] = {"rules": [rule]}
    if ing.class_name:
        spec = {"ingressClassName": ing.class_name, **spec}
    if ing.tls_secret and ing.host:
        spec["tls"] = [{"hosts": [ing.host], "secretName": ing.tls_secret}]
    component = "router" if svc.router.builtin else "engine"
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": object_meta(svc, owner, svc.name, component, annotations), "spec": spec}


# ---- autoscaling objects ------------------------------------------------------------------------------
def _hpa_behavior(svc: InferenceService) -> dict[str, Any]:
    """Scale up at once; scale down only after the load stayed low for cooldownSeconds."""
    return {"scaleDown": {"stabilizationWindowSeconds": svc.autoscaling.cooldown_seconds},
            "scaleUp": {"stabilizationWindowSeconds": 0}}


def build_hpa(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    a = svc.autoscaling
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": object_meta(svc, owner, engine_name(svc), "engine"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": engine_name(svc)},
                     "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
                     # NOTE: served by a Prometheus adapter, which renames ':' to '_'.
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": WAITING_METRIC.replace(":", "_")},
                         "target": {"type": "AverageValue", "averageValue": str(a.target_waiting_requests)}}}],
                     "behavior": _hpa_behavior(svc)}}


def build_scaled_object(svc: InferenceService, owner: Owner) -> dict[str, Any]:
    a = svc.autoscaling
    where = f'{{namespace="{svc.namespace}",model_name="{svc.model.served_name}"}}'

    def trigger(metric: str, threshold: int) -> dict[str, Any]:
        return {"type": "prometheus", "metadata": {"serverAddress": a.prometheus_address or "",
                                                   "query": f"sum({metric}{where})", "threshold": str(threshold)}}

    spec: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": engine_name(svc)},
        "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
        # NOTE: the HPA KEDA manages gets the cooldown as its scale-down window.
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _hpa_behavior(svc)}},
        "pollingInterval": 15,
        "triggers": [trigger("vllm:num_requests_waiting", a.target_waiting_requests)]}
    if scales_to_zero(svc):
        # NOTE: KEDA wakes the engines when any trigger exceeds its activationThreshold (0) and takes
        # them to zero once none has for cooldownPeriod. The router's held requests wake them (no engine
        # reports anything at zero); the running trigger keeps a pod busy with an empty queue, its
        # threshold (one full batch per pod) never asking for more pods than run those requests.
        spec["cooldownPeriod"] = a.scale_to_zero_after_seconds
        spec["triggers"] += [
            {**trigger(PENDING_METRIC, a.target_waiting_requests), "name": "router-held-requests"},
            {**trigger("vllm:num_requests_running", svc.engine.max_num_seqs), "name": "running-requests"}]
        for t in spec["triggers"]:
            t["metadata"]["activationThreshold"] = "0"
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": object_meta(svc, owner, engine_name(svc), "engine"), "spec": spec}


# ---- the whole set ---------------------------------------------------------------------------------------
ChildKey = tuple[str, str, str]  # (apiVersion, kind, name)


def possible_children(svc: InferenceService) -> list[ChildKey]:
    """Every child any spec of this service could have (to delete the ones no longer wanted)."""
    n = svc.name
    return [("v1", "ConfigMap", config_name(svc)), ("apps/v1", "Deployment", engine_name(svc)),
            ("v1", "Service", engine_name(svc)), ("apps/v1", "Deployment", router_name(svc)),
            ("v1", "Service", n), ("apps/v1", "Deployment", redis_name(svc)), ("v1", "Service", redis_name(svc)),
            ("networking.k8s.io/v1", "NetworkPolicy", redis_name(svc)),
            ("networking.k8s.io/v1", "Ingress", n),
            ("autoscaling/v2", "HorizontalPodAutoscaler", engine_name(svc)),
            ("keda.sh/v1alpha1", "ScaledObject", engine_name(svc))] + _pool_module().possible_pool_children(svc) \
        + _disagg_module().possible_role_children(svc)


def _pool_module() -> Any:
    # NOTE: imported late: inference_pool builds on this module's names, labels and metadata.
    from . import inference_pool
    return inference_pool


def _disagg_module() -> Any:
    # NOTE: imported late, as inference_pool: disaggregation builds on the engine Deployment here.
    from . import disaggregation
    return disaggregation


# NOTE: kinds whose RBAC is optional in the chart (a 403 means "not managed here", not a failure),
# with the chart value that grants it.
OPTIONAL_KINDS: dict[str, str] = {"HorizontalPodAutoscaler": "rbac.hpa", "ScaledObject": "rbac.keda",
                                  "InferencePool": "rbac.inferencePool", "ServiceAccount": "rbac.inferencePool",
                                  "Role": "rbac.inferencePool", "RoleBinding": "rbac.inferencePool"}


def engine_replicas(svc: InferenceService, autoscaled: int | None) -> int | None:
    """The engine Deployment's replicas: the spec, the operator's autoscaler, or None (HPA/KEDA own it)."""
    a = svc.autoscaling
    if not a.enabled:
        return svc.replicas
    if a.mode != "operator":
        return None
    start = autoscaled if autoscaled is not None else svc.replicas
    return min(max(start, a.min_replicas), a.max_replicas)


def build_children(svc: InferenceService, owner: Owner, replicas: int | None,
                   operator_namespace: str | None = None, redis_auth: str | None = None) -> list[dict[str, Any]]:
    """All objects this spec wants, in creation order (Redis and config before the pods using them).

    Not here: the managed Redis' password Secret, created once before these (`build_redis_secret`);
    `redis_auth` is the checksum of the Redis password Secret's data (None: unknown or none).
    """
    out: list[dict[str, Any]] = []
    if svc.redis.managed and needs_redis(svc):
        out += [build_redis_network_policy(svc, owner, operator_namespace),
                build_redis_deployment(svc, owner, redis_auth), build_redis_service(svc, owner)]
    if svc.engine.runtime == "kvmesh":
        out.append(build_config_map(svc, owner))
    if svc.disaggregation is None:
        out += [build_engine_service(svc, owner), build_engine_deployment(svc, owner, replicas, redis_auth)]
    else:
        out += _disagg_module().build_role_children(svc, owner, redis_auth)
    if svc.router.builtin:
        out.append(build_router_deployment(svc, owner, redis_auth))
    if svc.router.mode == "inference-pool":
        out += _pool_module().build_pool_children(svc, owner)
    out.append(build_front_service(svc, owner))
    if svc.ingress.enabled:
        out.append(build_ingress(svc, owner))
    if svc.autoscaling.enabled and svc.autoscaling.mode == "hpa":
        out.append(build_hpa(svc, owner))
    if svc.autoscaling.enabled and svc.autoscaling.mode == "keda":
        out.append(build_scaled_object(svc, owner))
    return out


def child_key(obj: dict[str, Any]) -> ChildKey:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
