"""The InferenceService CustomResourceDefinition, written once here.

`helm/kvmesh/crds/inferenceservices.yaml` and `manifests/crd.yaml` are generated from `crd_manifest()`
(`python -m kvmesh.operator.schema > manifests/crd.yaml`); a test keeps all three identical.
`kvmesh.operator.crd` parses specs with the same defaults and rules (a test checks that too).
"""
from __future__ import annotations

import sys
from typing import Any

import yaml

from kvmesh.common.config import KV_CACHE_DTYPES

from . import GROUP, KIND, PLURAL, VERSION

SCHEDULING_POLICIES = ["fcfs", "priority", "sjf", "dynamic"]
PREEMPTION_MODES = ["recompute", "swap", "auto"]
ROUTER_STRATEGIES = ["kv-aware", "round-robin", "least-loaded", "random"]
MODEL_SOURCES = ["builtin", "uri", "pvc"]
AUTOSCALING_MODES = ["operator", "hpa", "keda"]
OTLP_PROTOCOLS = ["grpc", "http/protobuf"]
PHASES = ["Pending", "Progressing", "Ready", "Failed", "Terminating"]
BLOCK_SIZES = [8, 16, 32, 64]
PULL_POLICIES = ["Always", "IfNotPresent", "Never"]
RUNTIMES = ["kvmesh", "vllm"]
OPENMP_WAIT_POLICIES = ["auto", "active", "passive"]
ROUTER_MODES = ["builtin", "inference-pool"]
FAILURE_MODES = ["FailOpen", "FailClose"]
NCCL_DEBUG_LEVELS = ["VERSION", "WARN", "INFO", "TRACE"]
DEFAULT_IMAGE = "ghcr.io/kvmesh/kvmesh:0.1.0"
DEFAULT_EPP_IMAGE = "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0"
# kvmesh serve / kvmesh router --cache-salt-from: none, api-key or header:NAME (an HTTP header name)
CACHE_SALT_PATTERN = r"^(none|api-key|header:[A-Za-z0-9][-A-Za-z0-9_]*)$"
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                    r"(\.[0-9]*)?)|(\.[0-9]+))))?$")
DEFAULT_REDIS_IMAGE = "redis:7.4.1-alpine"
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# model.uri's remote sources, as kvmesh.common.storage.uri parses them (bucket names: AWS's rules)
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
HF_URI_PATTERN = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@.+)?$"
# loraAdapters[].name: a `model` name clients send (and a label value of the engines' metrics)
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
REDIS_URL_PATTERN = r"^rediss?://.+"  # no unix:// or other schemes: the operator itself connects at deletion
# NOTE: child names are <name>-engine, -router, -redis, -engine-config…: a resource named like a
# child of another one (`foo-engine`) would collide with it (`foo`'s headless Service).
CHILD_SUFFIXES = ["-engine", "-router", "-redis", "-epp", "-prefill", "-decode"]
# Ingress annotations that inject raw proxy configuration (ingress-nginx *-snippet, NGINX Inc.
# *-snippets, HAProxy *-config-snippet, haproxy-ingress config-*): refused.
SNIPPET_ANNOTATION_PATTERN = r"snippet|/config-(backend|frontend|defaults|global|tcp|tcp-service)$"
# spec.disaggregation: the KV transfer's transport, and the `kvmesh serve` flags each role's engine
# arguments may not set (the operator sets them)
KV_TRANSFER_PROTOCOLS = ["tcp", "rdma"]
OPERATOR_ENGINE_FLAGS = ["--kv-transfer-config", "--config", "--host", "--port", "--pod-id", "--redis-url"]


def _obj(desc: str, props: dict[str, Any], required: list[str] | None = None,
         rules: list[dict[str, str]] | None = None, default: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": desc, "properties": props}
    if required:
        out["required"] = required
    if rules:
        out["x-kubernetes-validations"] = rules
    if default is not None:
        out["default"] = default
    return out


def _str(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **extra}


def _int(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "description": desc, **extra}


def _bool(desc: str, default: bool) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, "default": default}


def _num(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **extra}


def _string_map(desc: str) -> dict[str, Any]:
    return {"type": "object", "description": desc, "additionalProperties": {"type": "string"}}


def _quantity_map(desc: str) -> dict[str, Any]:
    quantity = {"anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
                "pattern": QUANTITY_PATTERN}
    return {"type": "object", "description": desc, "additionalProperties": quantity}


def _role_autoscaling_schema(role: str) -> dict[str, Any]:
    """spec.disaggregation.<role>.autoscaling: spec.autoscaling's fields, with the role's own metric
    targets (role_autoscaling.py): prefill scales on its queue, decode on its batch and KV cache."""
    waiting = ("Waiting requests per pod to aim for (kvmesh:num_requests_waiting: the prompts queued for "
               "a prefill pod).")
    running = ("Running requests per pod to aim for (kvmesh:num_requests_running). Default for decode when it "
               "sets no target: engine.maxNumSeqs (one full batch per pod).")
    kv = "KV-cache use per pod to aim for, in percent (kvmesh:kv_cache_usage_perc x 100)."
    return _obj(f"Scale the {role} engines on their own metrics: an HPA on Pods metrics served by a Prometheus "
                "adapter (mode hpa) or a KEDA ScaledObject on Prometheus queries (mode keda); every target set is "
                "one metric, and the role gets the most pods any of them asks for.", {
        "enabled": _bool("Turn this role's autoscaling on (its replicas is then ignored).", False),
        "mode": _str("hpa (an HorizontalPodAutoscaler) or keda (a ScaledObject); the operator's own autoscaler "
                     "scales colocated engines only.", enum=["hpa", "keda"], default="hpa"),
        "minReplicas": _int("Fewest pods of this role.", minimum=1, default=1),
        "maxReplicas": _int("Most pods of this role.", minimum=1, default=4),
        "targetWaitingRequests": (_int(waiting, minimum=1, default=4) if role == "prefill"
                                  else _int(waiting, minimum=1)),
        "targetRunningRequests": _int(running, minimum=1),
        "targetKVCacheUsagePercent": _int(kv, minimum=1, maximum=100),
        "cooldownSeconds": _int("Least time before scaling down.", minimum=0, default=300),
        "prometheusAddress": _str("Prometheus URL for keda mode.", pattern=r"^https?://.+"),
    }, rules=[{"rule": "self.minReplicas <= self.maxReplicas",
               "message": f"disaggregation.{role}.autoscaling.minReplicas must not exceed maxReplicas"},
              {"rule": "self.mode != 'keda' || has(self.prometheusAddress)",
               "message": f"disaggregation.{role}.autoscaling.prometheusAddress is required when its mode is keda"}],
        default={})


def _role_schema(role: str) -> dict[str, Any]:
    """One role of spec.disaggregation: its own pods, GPUs, engine flags and autoscaling."""
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return _obj(f"The {role} engines (<name>-{role}, --kv-transfer-config kv_role {kv_role}).", {
        "replicas": _int(f"{role.capitalize()} engine pods (ignored while this role's autoscaling is enabled).",
                         minimum=1, default=1),
        "gpus": _int("GPUs per engine pod of this role: 0 (CPU) or 1. Default: gpu.count.", minimum=0, maximum=1),
        "engineArgs": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 1024},
                       "description": f"Extra `kvmesh serve` flags of the {role} engines, after the shared "
                                      "engine settings (e.g. [--max-num-batched-tokens, '16384']); the flags "
                                      "the operator sets (" + ", ".join(OPERATOR_ENGINE_FLAGS) + ") are refused.",
                       "x-kubernetes-validations": [{
                           "rule": "self.all(a, " + " && ".join(
                               f"a != '{f}' && !a.startsWith('{f}=')" for f in OPERATOR_ENGINE_FLAGS) + ")",
                           "message": "engineArgs must not set " + ", ".join(OPERATOR_ENGINE_FLAGS)
                                      + ": the operator sets them"}]},
        "autoscaling": _role_autoscaling_schema(role),
    }, default={})


# spec.engine.speculativeConfig: vLLM's --speculative-config keys, camelCased (the operator writes
# them back in vLLM's spelling for both runtimes)
SPECULATIVE_METHODS = ["ngram", "draft_model"]
_SPECULATIVE_CONFIG = _obj(
    "Speculative decoding (--speculative-config, both runtimes): drafts verified in one forward of the model.", {
        "method": _str("ngram (prompt lookup in the request's own tokens, no model) or draft_model (a smaller "
                       "model of the same vocabulary).", enum=SPECULATIVE_METHODS),
        "numSpeculativeTokens": _int("Draft tokens proposed per request per step.", minimum=1, maximum=64),
        "promptLookupMin": _int("ngram: shortest suffix of the request's tokens looked up. Default: "
                                "promptLookupMax, or 5.", minimum=1),
        "promptLookupMax": _int("ngram: longest suffix looked up first. Default: promptLookupMin, or 5.",
                                minimum=1),
        "model": _str("draft_model: the draft's HF-format directory inside the engine pod (e.g. on the model's "
                      "claim under /models).", pattern="^/", maxLength=1024),
        "disableByBatchSize": _int("Speculation is off in a step while more requests than this run (runtime "
                                   "kvmesh only).", minimum=1),
    }, required=["method", "numSpeculativeTokens"], rules=[
        {"rule": "self.method != 'draft_model' || has(self.model)",
         "message": "engine.speculativeConfig.model is required with method draft_model"},
        {"rule": "self.method != 'ngram' || !has(self.model)",
         "message": "engine.speculativeConfig.model applies to method draft_model only"},
        {"rule": "self.method != 'draft_model' || (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
         "message": "engine.speculativeConfig.promptLookupMin / promptLookupMax apply to method ngram only"},
        {"rule": "!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
                 "self.promptLookupMin <= self.promptLookupMax",
         "message": "engine.speculativeConfig.promptLookupMin must not exceed promptLookupMax"}])


def _secret_ref(desc: str, default_key: str) -> dict[str, Any]:
    return _obj(desc, {
        "name": _str("Name of the Secret in the InferenceService's namespace.", pattern=K8S_NAME_PATTERN,
                     maxLength=253),
        "key": _str("Key inside the Secret.", default=default_key, minLength=1),
    }, required=["name"])


_TOLERATION = _obj("A toleration copied into the engine pods.", {
    "key": _str("Taint key the toleration applies to."),
    "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
    "value": _str("Taint value (with operator Equal)."),
    "effect": _str("Taint effect to match; empty matches all.",
                   enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
    "tolerationSeconds": {"type": "integer", "format": "int64",
                          "description": "How long a NoExecute taint is tolerated."},
})

SPEC_SCHEMA: dict[str, Any] = _obj("Desired state of one served model.", {
    "model": _obj("Where the weights come from.", {
        "source": _str("builtin (the image's bundled SmolLM2), uri (an absolute path inside the image, "
                       "or an s3:// / hf:// model fetched before the engine starts) or pvc (a "
                       "PersistentVolumeClaim mounted read-only at /models).",
                       enum=MODEL_SOURCES, default="builtin"),
        "uri": _str("Absolute path inside the image of an HF-format model directory (config.json, "
                    "*.safetensors, tokenizer.json) or a .gguf file; or s3://bucket/prefix or "
                    "hf://org/name[@revision], which an init container (`kvmesh fetch`) fetches into "
                    "model.cache; required when source is uri.", minLength=1),
        "endpoint": _str("S3-compatible endpoint of an s3:// uri (AWS_ENDPOINT_URL, path-style "
                         "addressing: MinIO, Ceph, ...); unset: AWS S3.", pattern=r"^https?://.+"),
        "credentials": _obj("Secret holding the credentials of an s3:// / hf:// uri (and of s3:// / hf:// "
                            "loraAdapters); each key, where the Secret has it, becomes the variable it is named "
                            "after.", {
            "secretName": _str("Secret in the InferenceService's namespace.", pattern=K8S_NAME_PATTERN,
                               maxLength=253),
            "accessKeyIdKey": _str("Key of AWS_ACCESS_KEY_ID.", default="AWS_ACCESS_KEY_ID", minLength=1),
            "secretAccessKeyKey": _str("Key of AWS_SECRET_ACCESS_KEY.", default="AWS_SECRET_ACCESS_KEY",
                                       minLength=1),
            "sessionTokenKey": _str("Key of AWS_SESSION_TOKEN.", default="AWS_SESSION_TOKEN", minLength=1),
            "hfTokenKey": _str("Key of HF_TOKEN.", default="HF_TOKEN", minLength=1),
        }, required=["secretName"]),
        "cache": _obj("Where an s3:// / hf:// model is fetched to: a directory of the node (hostPath, "
                      "writable by uid 10001: a second engine on the node starts without fetching) or a "
                      "PersistentVolumeClaim; neither: an emptyDir per pod.", {
            "hostPath": _str("Absolute directory on the node.", pattern=r"^/.+"),
            "claimName": _str("PersistentVolumeClaim (ReadWriteMany when several pods share it).",
                              pattern=K8S_NAME_PATTERN, maxLength=253),
            "maxSize": _str("Bound of the cache (KVMESH_MODEL_CACHE_MAX_SIZE, e.g. 100G or 500Gi): least "
                            "recently used models are evicted to make room.",
                            pattern=r"^[0-9]+(\.[0-9]+)?([kKmMgGtT]i?)?$"),
        }, rules=[{"rule": "!(has(self.hostPath) && has(self.claimName))",
                   "message": "model.cache takes hostPath or claimName, not both"}]),
        "pvc": _obj("The claim holding the weights; required when source is pvc.", {
            "claimName": _str("PersistentVolumeClaim name.", pattern=K8S_NAME_PATTERN, maxLength=253),
            "path": _str("Directory of the model inside the claim.", default=""),
        }, required=["claimName"]),
        "servedModelName": _str("Name clients send as `model`; defaults to the resource name.",
                                minLength=1, maxLength=128),
        "tokenizer": _str("Absolute path of a tokenizer directory (tokenizer.json) when it differs from the "
                          "weights: inside the image, or under /models on the model PVC.", minLength=1),
    }, rules=[
        {"rule": "self.source != 'uri' || has(self.uri)", "message": "model.uri is required when model.source is uri"},
        {"rule": "self.source != 'pvc' || has(self.pvc)", "message": "model.pvc is required when model.source is pvc"},
        {"rule": "!has(self.uri) || self.uri.startsWith('/') || self.uri.matches('" + S3_URI_PATTERN + "') || "
                 "self.uri.matches('" + HF_URI_PATTERN + "')",
         "message": "model.uri must be an absolute path inside the image, s3://bucket/prefix or "
                    "hf://org/name[@revision]"},
        {"rule": "!has(self.tokenizer) || self.tokenizer.startsWith('/')",
         "message": "model.tokenizer must be an absolute path (inside the image or under /models); Hugging Face "
                    "ids and URLs are not downloaded"},
    ], default={}),
    "image": _str(f"Image of the engine pods; pin a tag. Runtime kvmesh: an image running `kvmesh serve` "
                  f"(default {DEFAULT_IMAGE}); runtime vllm: a vLLM image with `vllm serve` (required).",
                  minLength=1),
    "imagePullPolicy": _str("Image pull policy of every container.", enum=PULL_POLICIES,
                            default="IfNotPresent"),
    "replicas": _int("Engine pods (ignored while autoscaling is enabled).", minimum=0, default=1),
    "gpu": _obj("Accelerators per engine pod.", {
        "count": _int("GPUs per engine pod; 0 runs on CPU.", minimum=0, maximum=16, default=1),
        "resourceName": _str("Extended resource name of the GPU.", default="nvidia.com/gpu",
                             pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$"),
        "nodeSelector": _string_map("Node labels the engine pods must match."),
        "tolerations": {"type": "array", "description": "Tolerations of the engine pods.",
                        "items": _TOLERATION},
    }, default={}),
    "resources": _obj("CPU and memory of each engine container (GPUs come from gpu).", {
        "requests": _quantity_map("Resource requests, e.g. cpu: '4', memory: 16Gi."),
        "limits": _quantity_map("Resource limits."),
    }),
    "engine": _obj("Engine settings, passed to `kvmesh serve`.", {
        "maxNumSeqs": _int("Most sequences in one batch.", minimum=1, maximum=65536, default=256),
        "maxNumBatchedTokens": _int("Token budget of one scheduler step.", minimum=1, default=8192),
        "blockSize": _int("Tokens per KV cache block.", enum=BLOCK_SIZES, default=16),
        "kvCacheMemoryFraction": _num("Fraction of accelerator memory for weights and KV cache.",
                                      minimum=0, exclusiveMinimum=True, maximum=1, default=0.9),
        "schedulingPolicy": _str("Scheduling policy.", enum=SCHEDULING_POLICIES, default="fcfs"),
        "enablePrefixCaching": _bool("Reuse KV blocks of shared prefixes.", True),
        "preemptionMode": _str("What to do with a preempted sequence's KV blocks.",
                               enum=PREEMPTION_MODES, default="recompute"),
        "kvCacheDtype": _str("The KV cache's element type (--kv-cache-dtype): auto (the model's dtype) or "
                             "8-bit floats, twice bf16's tokens in the same memory: fp8 (= fp8_e4m3) or "
                             "fp8_e5m2, on CPU and GPU engines alike; runtime vllm takes them as vLLM does.",
                             enum=list(KV_CACHE_DTYPES), default="auto"),
        "runtime": _str("kvmesh (`kvmesh serve`) or vllm (`vllm serve` from spec.image, kvmesh's router and index "
                        "in front, fed by vLLM's KV events).", enum=RUNTIMES, default="kvmesh"),
        "openmpWaitPolicy": _str("How the engine's OpenMP workers wait between parallel regions: "
                                 "auto lets them spin about 200 ms before sleeping (GOMP_SPINCOUNT) on a "
                                 "CPU engine whose CPU and memory requests equal its limits with whole CPUs "
                                 "(Guaranteed QoS, exclusive cores under the static CPU manager) and keeps "
                                 "the passive default elsewhere; active or passive set OMP_WAIT_POLICY.",
                                 enum=OPENMP_WAIT_POLICIES, default="auto"),
        "tensorParallelSize": _int("GPUs one model is sharded across (--tensor-parallel-size); must divide "
                                   "gpu.count. Default: gpu.count (1 on CPU).", minimum=1, maximum=16),
        "sharedMemorySize": {**_str("Size limit of the in-memory /dev/shm of the engine pods (NCCL and torch "
                                    "shared-memory tensors). Default: 2Gi, 8Gi with tensorParallelSize > 1."),
                             "pattern": QUANTITY_PATTERN},
        "nccl": _obj("NCCL settings of tensor-parallel engines (env of the engine pods when "
                     "tensorParallelSize > 1).", {
            "socketIfname": _str("NCCL_SOCKET_IFNAME: the network interface(s) NCCL's bootstrap uses, e.g. eth0 "
                                 "or ^lo,docker.", pattern=r"^\^?[A-Za-z0-9_.=:-]+(,[A-Za-z0-9_.=:-]+)*$",
                                 maxLength=128),
            "debug": _str("NCCL_DEBUG log level.", enum=NCCL_DEBUG_LEVELS, default="WARN"),
        }, default={}),
        "enableLora": _bool("Serve LoRA adapters (--enable-lora) even while loraAdapters is empty, so that "
                            "adding the first adapter or removing the last one does not roll the pods; on "
                            "by itself while loraAdapters has entries.", False),
        "maxLoras": _int("LoRA adapters in one batch (--max-loras): the adapter slots of every layer.",
                         minimum=1, maximum=256, default=1),
        "maxLoraRank": _int("Largest LoRA rank accepted (--max-lora-rank); every slot is sized for it.",
                            minimum=1, maximum=512, default=16),
        "maxCpuLoras": _int("LoRA adapters kept read in host memory, least recently used evicted "
                            "(--max-cpu-loras). Default: maxLoras.", minimum=1),
        "speculativeConfig": _SPECULATIVE_CONFIG,
    }, rules=[{"rule": "self.maxNumBatchedTokens >= self.maxNumSeqs",
               "message": "engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"},
              {"rule": "self.runtime != 'vllm' || self.schedulingPolicy in ['fcfs', 'priority']",
               "message": "engine.schedulingPolicy sjf and dynamic are kvmesh-only; runtime vllm takes fcfs or "
                          "priority"},
              {"rule": "self.runtime != 'vllm' || self.preemptionMode == 'recompute'",
               "message": "engine.preemptionMode swap and auto are kvmesh-only; runtime vllm recomputes"},
              {"rule": "!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
               "message": "engine.maxCpuLoras must be at least engine.maxLoras"}],
        default={}),
    "router": _obj("The KV-aware router in front of the engines.", {
        "enabled": _bool("Deploy the router; when false the Service points straight at the engines.", True),
        "strategy": _str("Routing strategy.", enum=ROUTER_STRATEGIES, default="kv-aware"),
        "replicas": _int("Router pods.", minimum=1, maximum=64, default=1),
        "mode": _str("builtin (kvmesh's router) or inference-pool (a Gateway API InferencePool and llm-d's "
                     "endpoint picker instead; a Gateway's HTTPRoute sends clients to the pool).",
                     enum=ROUTER_MODES, default="builtin"),
        "image": _str(f"Image running `kvmesh router`; default spec.image with runtime kvmesh, else "
                      f"{DEFAULT_IMAGE}.", minLength=1),
        "cacheSaltFrom": _str("Per-tenant prefix-cache isolation (--cache-salt-from of router and engines): none, "
                              "api-key (an HMAC of the Bearer key) or header:NAME (of that header's value).",
                              pattern=CACHE_SALT_PATTERN, default="none", maxLength=128),
        "exposeRouteHeaders": _bool("Add x-kvmesh-backend and x-kvmesh-route-reason to responses (diagnostics: "
                                    "they reveal backend addresses and cache hits).", False),
        "inferencePool": _obj("The endpoint picker of router.mode inference-pool.", {
            "endpointPickerImage": _str("Image of llm-d's inference scheduler (the endpoint picker); pin a tag.",
                                        default=DEFAULT_EPP_IMAGE, minLength=1),
            "failureMode": _str("What the gateway does when the endpoint picker does not answer: FailClose "
                                "(refuse the request) or FailOpen (send it to any pod of the pool).",
                                enum=FAILURE_MODES, default="FailClose"),
            "replicas": _int("Endpoint picker pods (more than one elect a leader).", minimum=1, maximum=8,
                             default=1),
        }, default={}),
    }, rules=[{"rule": "self.mode != 'inference-pool' || self.enabled",
               "message": "router.mode inference-pool needs router.enabled (the endpoint picker is the router)"},
              {"rule": "self.mode != 'inference-pool' || !self.exposeRouteHeaders",
               "message": "router.exposeRouteHeaders is a kvmesh router flag; router.mode inference-pool has none"}],
        default={}),
    "redis": _obj("The prefix index. Without url the operator runs a Redis for this service.", {
        "url": _str("External Redis, e.g. redis://redis.infra:6379/0 or rediss:// for TLS.",
                    pattern=REDIS_URL_PATTERN),
        "passwordSecret": _secret_ref("Secret holding the external Redis password.", "password"),
        "image": _str("Image of the managed Redis.", default=DEFAULT_REDIS_IMAGE, minLength=1),
        "caBundle": _obj("CA certificates of an external rediss:// Redis, mounted into the engine and router "
                         "pods; KVMESH_REDIS_CA_FILE names the file.", {
            "configMap": _str("ConfigMap holding the bundle.", pattern=K8S_NAME_PATTERN, maxLength=253),
            "secret": _str("Secret holding the bundle.", pattern=K8S_NAME_PATTERN, maxLength=253),
            "key": _str("Key of the bundle in the ConfigMap or Secret.", default="ca.crt", minLength=1,
                        pattern=r"^[-._a-zA-Z0-9]+$"),
        }, rules=[{"rule": "has(self.configMap) != has(self.secret)",
                   "message": "redis.caBundle needs exactly one of configMap or secret"}]),
    }, rules=[{"rule": "!has(self.url) || self.url.startsWith('redis://') || self.url.startsWith('rediss://')",
               "message": "redis.url must start with redis:// or rediss:// (no unix sockets or other schemes)"},
              {"rule": "!has(self.caBundle) || (has(self.url) && self.url.startsWith('rediss://'))",
               "message": "redis.caBundle needs a rediss:// redis.url (TLS)"},
              {"rule": "!has(self.passwordSecret) || has(self.url)",
               "message": "redis.passwordSecret needs redis.url (the managed Redis gets a generated password)"}],
        default={}),
    "autoscaling": _obj("Scale the engines on their waiting-queue length.", {
        "enabled": _bool("Turn autoscaling on (spec.replicas is then ignored).", False),
        "mode": _str("operator (the operator scales), hpa (an HPA on a Pods metric) or keda (a ScaledObject).",
                     enum=AUTOSCALING_MODES, default="operator"),
        "minReplicas": _int("Fewest engine pods; 0 scales the engines to zero after scaleToZeroAfterSeconds without "
                            "requests (operator and keda modes), the router holding requests until one is ready.",
                            minimum=0, default=1),
        "maxReplicas": _int("Most engine pods.", minimum=1, default=4),
        "targetWaitingRequests": _int("Waiting requests per pod to aim for.", minimum=1, default=4),
        "cooldownSeconds": _int("Least time between two scaling steps.", minimum=0, default=300),
        "prometheusAddress": _str("Prometheus URL for keda mode.", pattern=r"^https?://.+"),
        "scaleToZeroAfterSeconds": _int("With minReplicas 0: how long the engines stay without running, waiting or "
                                        "held requests before the last one goes (KEDA's cooldownPeriod).",
                                        minimum=1, default=300),
        "holdTimeoutSeconds": _int("With minReplicas 0: how long the router holds a request while no engine is "
                                   "ready (then 503 with Retry-After).", minimum=1, default=300),
    }, rules=[
        {"rule": "self.minReplicas <= self.maxReplicas",
         "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"},
        {"rule": "self.mode != 'keda' || has(self.prometheusAddress)",
         "message": "autoscaling.prometheusAddress is required when autoscaling.mode is keda"},
        {"rule": "self.minReplicas > 0 || self.mode != 'hpa'",
         "message": "autoscaling.minReplicas 0 needs mode operator or keda (an HPA does not scale to zero)"},
    ], default={}),
    "tracing": _obj("OpenTelemetry traces of the engines (the router does not trace).", {
        "otlpEndpoint": _str("OTLP endpoint, e.g. http://otel-collector.observability:4317 (gRPC) or "
                             ":4318 (http/protobuf).", pattern=r"^https?://.+"),
        "protocol": _str("OTLP protocol of otlpEndpoint (OTEL_EXPORTER_OTLP_PROTOCOL): grpc (port 4317) or "
                         "http/protobuf (port 4318).", enum=OTLP_PROTOCOLS, default="grpc"),
        "samplingRatio": _num("Share of traces sampled (parent-based).", minimum=0, maximum=1, default=0.1),
    }, default={}),
    "ingress": _obj("An Ingress in front of the service.", {
        "enabled": _bool("Create the Ingress.", False),
        "className": _str("IngressClass name.", pattern=K8S_NAME_PATTERN),
        "host": _str("Host name routed to the service.",
                     pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"),
        "tlsSecretName": _str("TLS Secret for host.", pattern=K8S_NAME_PATTERN),
        "annotations": {**_string_map("Extra Ingress annotations; configuration snippets (keys containing "
                                      "'snippet', haproxy-ingress config-*) are refused."), "maxProperties": 32},
    }, rules=[{"rule": "!has(self.tlsSecretName) || has(self.host)",
               "message": "ingress.tlsSecretName needs ingress.host"},
              {"rule": f"!has(self.annotations) || self.annotations.all(k, !k.matches('{SNIPPET_ANNOTATION_PATTERN}'))",
               "message": "ingress.annotations must not inject configuration snippets (*-snippet, *-snippets, "
                          "config-backend…)"}], default={}),
    "apiKeySecret": _secret_ref("Secret whose key is the API key clients must send.", "api-key"),
    "adminApiKeySecret": _secret_ref("Secret whose key the engines' admin endpoints (POST /reset_prefix_cache) "
                                     "require (--admin-api-key; runtime kvmesh). Default: the API key.",
                                     "admin-api-key"),
    "disaggregation": _obj(
        "Prefill/decode disaggregation (docs/DISAGGREGATION.md): two engine Deployments instead of one, "
        "<name>-prefill (kv_producer) and <name>-decode (kv_consumer), the prompt's KV cache handed from the one "
        "to the other over Mooncake's transfer engine, and the router in P/D mode in front. Runtime kvmesh, "
        "one GPU (or CPU) per engine pod; spec.replicas and spec.autoscaling then do not apply.", {
            "protocol": _str("The KV transfer's transport (kv_connector_extra_config.mooncake_protocol): tcp, "
                             "or rdma on nodes with RDMA NICs.", enum=KV_TRANSFER_PROTOCOLS, default="tcp"),
            "deviceName": _str("RDMA device(s) of protocol rdma, e.g. mlx5_0 (device_name).",
                               pattern=r"^[A-Za-z0-9_.,-]+$", maxLength=256),
            "prefill": _role_schema("prefill"),
            "decode": _role_schema("decode"),
        }, required=["prefill", "decode"],
        rules=[{"rule": "self.protocol == 'rdma' || !has(self.deviceName)",
                "message": "disaggregation.deviceName needs disaggregation.protocol rdma"}]),
    "loraAdapters": {
        "type": "array", "maxItems": 256,
        "description": "LoRA adapters served on the model, each a `model` name of its own. The operator loads "
                       "and unloads them on the running engine pods (POST /v1/load_lora_adapter, with the admin "
                       "key): changing this list never rolls the pods.",
        "items": _obj("One adapter (PEFT format: adapter_config.json + adapter_model.safetensors).", {
            "name": _str("The `model` name clients send for it.", pattern=LORA_NAME_PATTERN, maxLength=128),
            "source": _str("An absolute path in the image or under /models (the model claim), "
                           "pvc://<model claim>/path, or s3://bucket/prefix / hf://org/name[@revision] (fetched "
                           "by the engine pod into model.cache, with model.credentials).",
                           minLength=1, maxLength=1024),
        }, required=["name", "source"]),
        "x-kubernetes-validations": [
            {"rule": "self.all(a, self.exists_one(b, b.name == a.name))",
             "message": "loraAdapters names must be unique"},
            {"rule": "self.all(a, a.source.startsWith('/') || a.source.startsWith('pvc://') || "
                     "a.source.matches('" + S3_URI_PATTERN + "') || a.source.matches('" + HF_URI_PATTERN + "'))",
             "message": "loraAdapters[].source must be an absolute path, pvc://claim/path, s3://bucket/prefix or "
                        "hf://org/name[@revision]"},
        ],
    },
}, required=["model"], rules=[
    {"rule": "self.engine.runtime != 'vllm' || has(self.image)",
     "message": "spec.image is required with engine.runtime vllm (a vLLM image, e.g. vllm/vllm-openai:v0.11.0)"},
    {"rule": "self.engine.runtime != 'vllm' || self.model.source != 'builtin'",
     "message": "engine.runtime vllm needs model.source uri or pvc (the built-in model ships in kvmesh's image)"},
    {"rule": "self.engine.runtime != 'vllm' || !has(self.model.uri) || !(self.model.uri.startsWith('s3://') "
             "|| self.model.uri.startsWith('hf://'))",
     "message": "engine.runtime vllm needs a model.uri inside the image: s3:// and hf:// models are fetched "
                "for runtime kvmesh"},
    {"rule": "self.engine.runtime != 'vllm' || self.gpu.count > 0 || self.engine.blockSize % 32 == 0",
     "message": "engine.blockSize must be 32 or 64 with runtime vllm on CPU (gpu.count 0): vLLM's CPU build takes "
                "multiples of 32 only"},
    {"rule": "self.engine.runtime != 'vllm' || !has(self.adminApiKeySecret)",
     "message": "adminApiKeySecret is a kvmesh engine flag; runtime vllm has no admin key"},
    {"rule": "self.engine.runtime != 'vllm' || self.router.cacheSaltFrom == 'none'",
     "message": "router.cacheSaltFrom needs runtime kvmesh (vLLM engines do not salt their blocks per tenant)"},
    {"rule": "(self.engine.runtime != 'vllm' && self.router.mode != 'inference-pool') || "
             "self.engine.enablePrefixCaching",
     "message": "engine.enablePrefixCaching must stay true with runtime vllm or router.mode inference-pool (the "
                "router learns the engines' blocks from their KV events)"},
    {"rule": "!has(self.engine.tensorParallelSize) || self.engine.tensorParallelSize == 1 || self.gpu.count > 0",
     "message": "engine.tensorParallelSize > 1 needs GPUs (gpu.count > 0)"},
    {"rule": "!has(self.engine.tensorParallelSize) || self.gpu.count == 0 || "
             "self.gpu.count % self.engine.tensorParallelSize == 0",
     "message": "engine.tensorParallelSize must divide gpu.count"},
    {"rule": "!has(self.engine.speculativeConfig) || self.engine.speculativeConfig.method != 'draft_model' || "
             "self.engine.runtime != 'kvmesh' || (has(self.engine.tensorParallelSize) ? "
             "self.engine.tensorParallelSize == 1 : self.gpu.count <= 1)",
     "message": "engine.speculativeConfig method draft_model needs tensorParallelSize 1 with runtime kvmesh"},
    {"rule": "self.engine.runtime != 'vllm' || !has(self.engine.speculativeConfig) || "
             "!has(self.engine.speculativeConfig.disableByBatchSize)",
     "message": "engine.speculativeConfig.disableByBatchSize is kvmesh-only; vLLM's speculative config has no "
                "such key"},
    {"rule": "self.router.mode != 'inference-pool' || self.model.source == 'pvc'",
     "message": "router.mode inference-pool needs model.source pvc (the endpoint picker reads the tokenizer from "
                "the claim)"},
    {"rule": "self.router.mode != 'inference-pool' || !has(self.model.tokenizer) || "
             "self.model.tokenizer.startsWith('/models/')",
     "message": "model.tokenizer must be under /models with router.mode inference-pool (the endpoint picker mounts "
                "only the model claim)"},
    {"rule": "self.router.mode != 'inference-pool' || !self.ingress.enabled",
     "message": "ingress.enabled does not apply to router.mode inference-pool: route a Gateway (HTTPRoute) to "
                "the InferencePool instead"},
    {"rule": "!self.autoscaling.enabled || self.autoscaling.minReplicas > 0 || "
             "(self.router.enabled && self.router.mode == 'builtin')",
     "message": "autoscaling.minReplicas 0 needs kvmesh's router (router.enabled, mode builtin): it holds the "
                "requests that wake the engines"},
    # NOTE: a spec-level rule (not model's): with LoRA on, the engines fetch s3:// / hf:// adapters
    # with the model's endpoint, credentials and cache
    {"rule": "(!has(self.model.credentials) && !has(self.model.endpoint) && !has(self.model.cache)) || "
             "(has(self.model.uri) && (self.model.uri.startsWith('s3://') || self.model.uri.startsWith('hf://'))) "
             "|| self.engine.enableLora || (has(self.loraAdapters) && size(self.loraAdapters) > 0)",
     "message": "model.credentials, model.endpoint and model.cache apply to an s3:// or hf:// model.uri, or to "
                "LoRA adapters (engine.enableLora, loraAdapters)"},
    {"rule": "self.engine.runtime != 'vllm' || (!self.engine.enableLora && "
             "(!has(self.loraAdapters) || size(self.loraAdapters) == 0))",
     "message": "engine.enableLora and loraAdapters need runtime kvmesh (the operator loads adapters through "
                "kvmesh's admin endpoints)"},
    {"rule": "!has(self.loraAdapters) || !has(self.model.servedModelName) || "
             "self.loraAdapters.all(a, a.name != self.model.servedModelName)",
     "message": "loraAdapters names must differ from model.servedModelName"},
    {"rule": "!has(self.loraAdapters) || self.loraAdapters.all(a, !a.source.startsWith('pvc://') || "
             "(self.model.source == 'pvc' && has(self.model.pvc) && "
             "a.source.startsWith('pvc://' + self.model.pvc.claimName + '/')))",
     "message": "a pvc:// loraAdapters source must be a path on the model's claim (model.source pvc, "
                "pvc://<model.pvc.claimName>/path): the engine pods mount that claim only"},
])

# NOTE: spec-level rules: they relate spec.disaggregation to the rest of the spec
SPEC_SCHEMA["x-kubernetes-validations"] += [
    {"rule": "!has(self.disaggregation) || self.engine.runtime == 'kvmesh'",
     "message": "disaggregation needs engine.runtime kvmesh (its engines take kvmesh's --kv-transfer-config)"},
    {"rule": "!has(self.disaggregation) || (self.router.enabled && self.router.mode == 'builtin')",
     "message": "disaggregation needs kvmesh's router (router.enabled, mode builtin): it runs the two hops"},
    {"rule": "!has(self.disaggregation) || !self.autoscaling.enabled",
     "message": "disaggregation scales each role on its own (disaggregation.prefill.autoscaling, "
                "disaggregation.decode.autoscaling): leave spec.autoscaling disabled"},
    {"rule": "!has(self.disaggregation) || !has(self.engine.tensorParallelSize) || "
             "self.engine.tensorParallelSize == 1",
     "message": "disaggregation needs engine.tensorParallelSize 1 (a KV transfer moves one engine's cache)"},
    {"rule": "!has(self.disaggregation) || self.gpu.count <= 1 || (has(self.disaggregation.prefill.gpus) && "
             "has(self.disaggregation.decode.gpus))",
     "message": "disaggregation runs one GPU per engine pod: set gpu.count to 0 or 1, or each role's gpus"},
]

_CONDITION = _obj("A KServe-style condition.", {
    "type": _str("ChildrenOwned, ModelReady, EnginesReady, RouterReady, RedisReady, IngressReady, "
                 "AutoscalingReady, InferencePoolReady, AdaptersReady, DisaggregationReady or Ready."),
    "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
    "reason": _str("One-word reason."),
    "message": _str("Human-readable detail."),
    "lastTransitionTime": _str("When status last changed.", format="date-time"),
}, required=["type", "status"])

STATUS_SCHEMA: dict[str, Any] = _obj("Observed state, written by the operator.", {
    "phase": _str("Pending, Progressing, Ready, Failed or Terminating.", enum=PHASES),
    "observedGeneration": {"type": "integer", "format": "int64",
                           "description": "metadata.generation this status describes."},
    "model": _str("Served model name."),
    "replicas": _int("Engine pods wanted (what the Replicas column shows)."),
    "readyReplicas": _int("Engine pods ready."),
    "selector": _str("Label selector of the engine pods (scale subresource)."),
    "url": _str("Where clients reach the OpenAI API."),
    "lastScaleTime": _str("When the operator's autoscaler last changed replicas.", format="date-time"),
    "lastActiveTime": _str("When the operator's autoscaler last saw a running, waiting or held request "
                           "(minReplicas 0: the idle period counts from here).", format="date-time"),
    "redisAuthChecksum": _str("Checksum of the Redis password on the pod templates (a new password rolls the "
                              "pods); kept for when the operator may not read the Secret back."),
    "childFingerprints": _string_map("Per child (Kind/name): a hash of the fields the operator owns as its last "
                                     "write left them; a different live hash means an edit to revert."),
    "conditions": {"type": "array", "description": "Conditions.", "items": _CONDITION,
                   "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    "loraAdapters": {"type": "array", "description": "Each adapter of spec.loraAdapters on the ready engine pods.",
                     "items": _obj("One adapter's state.", {
                         "name": _str("The adapter's name."),
                         "source": _str("Its source, as in the spec."),
                         "ready": {"type": "boolean", "description": "Loaded on every ready engine pod."},
                         "pods": {"type": "array", "items": {"type": "string"},
                                  "description": "The ready engine pods that serve it."},
                         "reason": _str("Loaded, Loading, or why it is not: NotFound, FetchFailed, RankTooLarge, "
                                        "UnsupportedTarget, BaseModelMismatch, Refused, PodUnreachable."),
                         "message": _str("The engine's answer for a refused adapter (pod: message)."),
                     }, required=["name"])},
    "modelStorage": _obj("An s3:// / hf:// model as the fetch-model init containers reported it (the "
                         "fetch that read the most from the store).", {
        "uri": _str("The model's URI."),
        "sizeBytes": {"type": "integer", "format": "int64", "description": "The model's bytes on disk."},
        "fetchedBytes": {"type": "integer", "format": "int64",
                         "description": "Bytes read from the store by that fetch (0: the node cache had it)."},
        "fetchSeconds": _num("That fetch's wall time in seconds."),
        "cachedPods": _int("Engine pods that found the model in their node's cache."),
    }),
})


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    columns = [
        ("Model", "string", ".status.model"), ("Replicas", "integer", ".status.replicas"),
        ("Ready", "integer", ".status.readyReplicas"), ("Phase", "string", ".status.phase"),
        ("URL", "string", ".status.url"), ("Age", "date", ".metadata.creationTimestamp"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/part-of": "kvmesh"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "inferenceservice", "kind": KIND,
                      "listKind": f"{KIND}List", "shortNames": ["kisvc"], "categories": ["kvmesh"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": [{"name": n, "type": t, "jsonPath": p} for n, t, p in columns],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A model served by kvmesh engines behind a KV-aware router.",
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": SPEC_SCHEMA, "status": STATUS_SCHEMA,
                    },
                    "required": ["spec"],
                    "x-kubernetes-validations": [{
                        "rule": "self.metadata.name.size() <= 45",
                        "message": "metadata.name must be at most 45 characters (child names add suffixes)"}, {
                        "rule": " && ".join(f"!self.metadata.name.endsWith('{x}')" for x in CHILD_SUFFIXES),
                        "message": "metadata.name must not end in " + ", ".join(CHILD_SUFFIXES)
                                   + " (it would collide with another InferenceService's children)"}],
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `python -m kvmesh.operator.schema`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
