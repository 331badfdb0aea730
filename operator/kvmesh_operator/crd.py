"""InferenceService spec → frozen, validated dataclasses.

The API server enforces the CRD schema (`schema.py`), but the operator validates again: kmock and
old API servers do not run CEL rules, and a bad spec must become a clear condition, never a
half-built service. Defaults here equal the schema's `default:` values (a test checks it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvmesh.common.speculative_config import parse_speculative_config
from kvmesh.common.storage import FetchError, is_uri, parse_source

from . import schema as S


class SpecError(ValueError):
    """The spec cannot be served; `problems` lists every reason, each saying how to fix it."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str  # Secret in the service's namespace
    key: str  # key inside it


@dataclass(frozen=True, slots=True)
class FetchCredentials:
    secret_name: str  # Secret in the service's namespace
    keys: tuple[tuple[str, str], ...]  # (variable, key in the Secret), each set where the Secret has it


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    host_path: str | None = None  # a node directory: engines on one node share what was fetched
    claim_name: str | None = None  # or a PersistentVolumeClaim; neither: an emptyDir per pod
    max_size: str | None = None  # KVMESH_MODEL_CACHE_MAX_SIZE (LRU eviction beyond it)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    source: str  # builtin | uri | pvc
    uri: str | None  # source uri: a path inside the image (HF directory or .gguf), s3:// or hf://
    pvc_claim: str | None  # claim mounted read-only at /models when source is pvc
    pvc_path: str  # model directory inside the claim
    served_name: str  # what clients send as `model`; the resource name by default
    tokenizer: str | None  # absolute path of a tokenizer directory, when not next to the weights
    endpoint: str | None = None  # AWS_ENDPOINT_URL of an s3:// uri
    credentials: FetchCredentials | None = None  # the fetch's Secret (s3:// / hf://)
    cache: ModelCacheSpec = ModelCacheSpec()  # where an s3:// / hf:// model is fetched to

    @property
    def remote(self) -> bool:
        """An s3:// / hf:// model: an init container fetches it before the engine starts."""
        return self.source == "uri" and is_uri(self.uri or "")


@dataclass(frozen=True, slots=True)
class GPUSpec:
    count: int  # GPUs per engine pod; 0 = CPU
    resource_name: str  # e.g. nvidia.com/gpu
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class NCCLSpec:
    socket_ifname: str | None  # NCCL_SOCKET_IFNAME; None: NCCL picks the interface
    debug: str  # NCCL_DEBUG


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """spec.engine.speculativeConfig, in vLLM's --speculative-config keys (both runtimes take them)."""
    method: str  # ngram | draft_model
    num_speculative_tokens: int  # drafts per request per step
    prompt_lookup_min: int | None = None  # ngram; None: the engine's default
    prompt_lookup_max: int | None = None  # ngram; None: the engine's default
    model: str | None = None  # draft_model: the draft's directory inside the engine pod
    disable_by_batch_size: int | None = None  # no speculation in a step running more requests

    def to_json(self) -> str:
        """The flag's value: the keys that are set, compact and sorted (stable config hash)."""
        keys = {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}
        return json.dumps(keys, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_memory_fraction: float
    scheduling_policy: str
    enable_prefix_caching: bool
    preemption_mode: str
    runtime: str = "kvmesh"  # kvmesh | vllm: which server the engine pods run
    tensor_parallel_size: int = 1  # GPUs one model is sharded across; divides gpu.count
    shared_memory_size: str = "2Gi"  # sizeLimit of the in-memory /dev/shm
    nccl: NCCLSpec = NCCLSpec(None, "WARN")
    enable_lora: bool = False  # engine.enableLora: --enable-lora even with no adapter in the spec
    max_loras: int = 1  # --max-loras
    max_lora_rank: int = 16  # --max-lora-rank
    max_cpu_loras: int | None = None  # --max-cpu-loras; None: the engine's default (max_loras)
    speculative_config: SpeculativeSpec | None = None  # engine.speculativeConfig; None: no speculation
    openmp_wait_policy: str = "auto"  # engine.openmpWaitPolicy: auto | active | passive (openmp_wait.py)
    kv_cache_dtype: str = "auto"  # engine.kvCacheDtype: --kv-cache-dtype


@dataclass(frozen=True, slots=True)
class InferencePoolSpec:
    endpoint_picker_image: str  # llm-d's inference scheduler
    failure_mode: str  # FailOpen | FailClose (the InferencePool's endpointPickerRef.failureMode)
    replicas: int  # endpoint picker pods


@dataclass(frozen=True, slots=True)
class RouterSpec:
    enabled: bool  # false: the Service selects the engines directly
    strategy: str
    replicas: int
    mode: str = "builtin"  # builtin (kvmesh's router) | inference-pool (InferencePool + llm-d's endpoint picker)
    image: str = S.DEFAULT_IMAGE  # runs `kvmesh router`
    cache_salt_from: str = "none"  # --cache-salt-from of router and engines: none | api-key | header:NAME
    expose_route_headers: bool = False  # --expose-route-headers
    inference_pool: InferencePoolSpec = InferencePoolSpec(S.DEFAULT_EPP_IMAGE, "FailClose", 1)

    @property
    def builtin(self) -> bool:
        """kvmesh's own router runs (enabled, and not replaced by an InferencePool)."""
        return self.enabled and self.mode == "builtin"


@dataclass(frozen=True, slots=True)
class CABundleRef:
    """The CA certificate(s) of an external rediss:// Redis: one key of a ConfigMap or a Secret."""
    kind: str  # ConfigMap | Secret, in the service's namespace
    name: str
    key: str


@dataclass(frozen=True, slots=True)
class RedisSpec:
    url: str | None  # None: the operator runs a Redis for this service
    password_secret: SecretRef | None
    image: str  # image of the managed Redis
    ca_bundle: CABundleRef | None = None  # external rediss:// only

    @property
    def managed(self) -> bool:
        return self.url is None


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    enabled: bool
    mode: str  # operator | hpa | keda
    min_replicas: int
    max_replicas: int
    target_waiting_requests: int  # waiting requests per pod to aim for
    cooldown_seconds: int  # least time between two scaling steps
    prometheus_address: str | None  # keda mode only
    # scale to zero (min_replicas 0): the idle time before the last engine goes, and how long the
    # router holds a request while no engine is ready
    scale_to_zero_after_seconds: int = 300
    hold_timeout_seconds: int = 300


@dataclass(frozen=True, slots=True)
class TracingSpec:
    otlp_endpoint: str | None  # None: tracing off
    sampling_ratio: float
    protocol: str  # grpc | http/protobuf (OTEL_EXPORTER_OTLP_PROTOCOL)


@dataclass(frozen=True, slots=True)
class IngressSpec:
    enabled: bool
    class_name: str | None
    host: str | None
    tls_secret: str | None
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoRAAdapterSpec:
    name: str  # the `model` name clients send
    source: str  # the engine's lora_path: an absolute path, pvc://, s3:// or hf:// (fetched on the pod)


@dataclass(frozen=True, slots=True)
class RoleAutoscalingSpec:
    """One role's autoscaler (role_autoscaling.py): an HPA or a KEDA ScaledObject on the role's
    own metric targets; each target set is one metric, and the role runs what the busiest asks."""
    enabled: bool
    min_replicas: int
    max_replicas: int
    target_waiting_requests: int | None  # waiting requests per pod (prefill's queue; default 4 there)
    cooldown_seconds: int  # the scale-down stabilization window
    mode: str = "hpa"  # hpa | keda (the operator's own autoscaler scales colocated engines only)
    target_running_requests: int | None = None  # running requests per pod (decode's batch)
    target_kv_cache_usage_percent: int | None = None  # KV-cache use per pod, percent (decode's memory)
    prometheus_address: str | None = None  # keda mode only


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """One role of spec.disaggregation."""
    role: str  # prefill | decode
    replicas: int
    gpus: int  # per engine pod: 0 (CPU) or 1
    engine_args: tuple[str, ...]  # extra `kvmesh serve` flags of this role
    autoscaling: RoleAutoscalingSpec

    @property
    def kv_role(self) -> str:
        """The role's --kv-transfer-config kv_role."""
        return "kv_producer" if self.role == "prefill" else "kv_consumer"


@dataclass(frozen=True, slots=True)
class DisaggregationSpec:
    protocol: str  # tcp | rdma (mooncake_protocol)
    device_name: str | None  # RDMA device(s) (device_name)
    prefill: RoleSpec
    decode: RoleSpec

    @property
    def roles(self) -> tuple[RoleSpec, RoleSpec]:
        return self.prefill, self.decode


@dataclass(frozen=True, slots=True)
class InferenceService:
    """One parsed InferenceService: everything the builders need, nothing from the cluster."""
    name: str
    namespace: str
    model: ModelSpec
    image: str
    image_pull_policy: str
    replicas: int
    gpu: GPUSpec
    resources: dict[str, dict[str, Any]]
    engine: EngineSpec
    router: RouterSpec
    redis: RedisSpec
    autoscaling: AutoscalingSpec
    tracing: TracingSpec
    ingress: IngressSpec
    api_key_secret: SecretRef | None
    admin_api_key_secret: SecretRef | None = None  # kvmesh engines' --admin-api-key
    lora_adapters: tuple[LoRAAdapterSpec, ...] = ()  # loaded at run time, never in the pod template
    disaggregation: DisaggregationSpec | None = None  # None: colocated engines (one Deployment)

    @property
    def lora_enabled(self) -> bool:
        """Do the engines run with --enable-lora (and the operator keep their adapters in sync)?"""
        return self.engine.enable_lora or bool(self.lora_adapters)

    @property
    def kv_events(self) -> bool:
        """Do the engines publish vLLM-format KV events over ZMQ (for kvmesh's router or llm-d's)?"""
        return self.engine.runtime == "vllm" or self.router.mode == "inference-pool"


class _Reader:
    """Reads one sub-object with the schema's types and defaults, collecting problems."""

    def __init__(self, data: Any, path: str, problems: list[str], schema: dict[str, Any]) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            problems.append(f"{path} must be an object, got {type(data).__name__}")
            data = {}
        self.data, self.path, self.problems, self.schema = data, path, problems, schema
        for key in data:
            if key not in schema["properties"]:
                problems.append(f"{path}.{key} is not a known field (known: "
                                f"{', '.join(sorted(schema['properties']))})")

    def sub(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.path}.{key}", self.problems, self.schema["properties"][key])

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str) -> Any:
        prop = self.schema["properties"][key]
        where = f"{self.path}.{key}"
        value = self.data.get(key, prop.get("default"))
        if value is None:
            return None
        kind = prop.get("type")
        if kind == "string":
            if not isinstance(value, str):
                return self._bad(f"{where} must be a string")
            if "enum" in prop and value not in prop["enum"]:
                return self._bad(f"{where} must be one of {', '.join(prop['enum'])}, got {value!r}")
            if "pattern" in prop and not re.search(prop["pattern"], value):
                return self._bad(f"{where} {value!r} does not match {prop['pattern']}")
            if len(value) < prop.get("minLength", 0) or len(value) > prop.get("maxLength", 1 << 30):
                return self._bad(f"{where} must have {prop.get('minLength', 0)} to "
                                 f"{prop.get('maxLength', 'any')} characters")
        elif kind in ("integer", "number"):
            ok = (int,) if kind == "integer" else (int, float)
            if isinstance(value, bool) or not isinstance(value, ok):
                return self._bad(f"{where} must be a{'n integer' if kind == 'integer' else ' number'}")
            if "enum" in prop and value not in prop["enum"]:
                return self._bad(f"{where} must be one of {', '.join(map(str, prop['enum']))}, got {value}")
            low, high = prop.get("minimum"), prop.get("maximum")
            if low is not None and (value < low or (prop.get("exclusiveMinimum") and value == low)):
                return self._bad(f"{where} must be {'>' if prop.get('exclusiveMinimum') else '>='} {low}, "
                                 f"got {value}")
            if high is not None and value > high:
                return self._bad(f"{where} must be <= {high}, got {value}")
        elif kind == "boolean" and not isinstance(value, bool):
            return self._bad(f"{where} must be true or false")
        elif kind == "object" and "additionalProperties" in prop:
            if not isinstance(value, dict):
                return self._bad(f"{where} must be a map")
            if prop["additionalProperties"].get("type") == "string" and not all(
                    isinstance(v, str) for v in value.values()):
                return self._bad(f"{where} values must be strings (quote numbers and booleans)")
        elif kind == "array" and not isinstance(value, list):
            return self._bad(f"{where} must be a list")
        return value

    def _bad(self, message: str) -> None:
        self.problems.append(message)
        return None


def _secret(reader: _Reader, key: str) -> SecretRef | None:
    if not reader.has(key):
        return None
    sub = reader.sub(key)
    name = sub.get("name")
    if name is None:
        reader.problems.append(f"{sub.path}.name is required")
        return None
    return SecretRef(name=name, key=sub.get("key"))


_CREDENTIAL_KEYS = (("AWS_ACCESS_KEY_ID", "accessKeyIdKey"), ("AWS_SECRET_ACCESS_KEY", "secretAccessKeyKey"),
                    ("AWS_SESSION_TOKEN", "sessionTokenKey"), ("HF_TOKEN", "hfTokenKey"))


def _credentials(m: _Reader) -> FetchCredentials | None:
    if not m.has("credentials"):
        return None
    c = m.sub("credentials")
    if c.get("secretName") is None:
        c.problems.append(f"{c.path}.secretName is required")
        return None
    return FetchCredentials(c.get("secretName"), tuple((var, c.get(key)) for var, key in _CREDENTIAL_KEYS))


def _model_cache(m: _Reader, problems: list[str]) -> ModelCacheSpec:
    if not m.has("cache"):
        return ModelCacheSpec()
    c = m.sub("cache")
    cache = ModelCacheSpec(c.get("hostPath"), c.get("claimName"), c.get("maxSize"))
    if cache.host_path is not None and cache.claim_name is not None:
        problems.append("spec.model.cache takes hostPath or claimName, not both")
    return cache


def _model_uri_problems(model: ModelSpec, lora: bool) -> list[str]:
    """`lora`: LoRA is on, so the engines fetch s3:// / hf:// adapters with the fetch settings."""
    problems = []
    if (model.uri or "").startswith(("s3://", "hf://")):
        try:
            parse_source(model.uri)
        except FetchError as e:
            problems.append(f"spec.model.uri {e}")
    elif (problem := _local_path_problem("spec.model.uri", model.uri, "an HF-format directory or a .gguf "
                                         "file inside the image", remote=True)) is not None:
        problems.append(problem)
    if (problem := _local_path_problem("spec.model.tokenizer", model.tokenizer, "a tokenizer directory")) is not None:
        problems.append(problem)
    fetch_fields = [f for f, v in (("credentials", model.credentials), ("endpoint", model.endpoint),
                                   ("cache", model.cache != ModelCacheSpec())) if v]
    if fetch_fields and not lora and not (model.uri or "").startswith(("s3://", "hf://")):
        problems.append(f"spec.model.{', spec.model.'.join(fetch_fields)}: only for an s3:// or hf:// "
                        "spec.model.uri (what the init container fetches) or LoRA adapters (what the engines "
                        "fetch)")
    return problems


def _local_path_problem(where: str, value: Any, what: str, remote: bool = False) -> str | None:
    """The engine and router open local files only (services/engine/loader.py): no ids, no URLs."""
    if not isinstance(value, str) or value.startswith("/"):
        return None
    kind = "a URL" if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) else "not an absolute path"
    if remote:
        return (f"{where} {value!r} is {kind}: it must be an absolute path to {what}, s3://bucket/prefix "
                f"or hf://org/name[@revision] (or use source: pvc and a path under /models)")
    return (f"{where} {value!r} is {kind}: it must be an absolute path to {what}; Hugging Face ids and "
            f"URLs are not downloaded (bake the files into the image, or use source: pvc and a path under "
            f"/models)")


def _speculative(engine: _Reader, problems: list[str]) -> SpeculativeSpec | None:
    """engine.speculativeConfig, checked by the engine's own validator (one source of truth for
    what `--speculative-config` accepts)."""
    if not engine.has("speculativeConfig"):
        return None
    r = engine.sub("speculativeConfig")
    before = len(problems)
    values = {key: r.get(camel) for key, camel in (
        ("method", "method"), ("num_speculative_tokens", "numSpeculativeTokens"),
        ("prompt_lookup_min", "promptLookupMin"), ("prompt_lookup_max", "promptLookupMax"),
        ("model", "model"), ("disable_by_batch_size", "disableByBatchSize"))}
    for key in ("method", "numSpeculativeTokens"):
        if not r.has(key):
            problems.append(f"{r.path}.{key} is required")
    if len(problems) > before:
        return None
    spec = SpeculativeSpec(**values)
    try:
        parse_speculative_config(spec.to_json())
    except ValueError as e:
        problems.append(f"{r.path}: {str(e).removeprefix('--speculative-config: ')}")
        return None
    return spec


def parse(name: str, namespace: str, spec: Any) -> InferenceService:
    """Parse and validate a spec; raises SpecError listing every problem."""
    problems: list[str] = []
    root = _Reader(spec, "spec", problems, S.SPEC_SCHEMA)
    if not root.has("model"):
        problems.append("spec.model is required (use `model: {source: builtin}` for the bundled model)")

    m = root.sub("model")
    pvc = m.sub("pvc") if m.has("pvc") else None
    if pvc is not None and pvc.get("claimName") is None:
        problems.append("spec.model.pvc.claimName is required")
    model = ModelSpec(source=m.get("source"), uri=m.get("uri"),
                      pvc_claim=pvc.get("claimName") if pvc else None,
                      pvc_path=(pvc.get("path") if pvc else "") or "",
                      served_name=m.get("servedModelName") or name, tokenizer=m.get("tokenizer"),
                      endpoint=m.get("endpoint"), credentials=_credentials(m),
                      cache=_model_cache(m, problems))
    engine_data = root.data.get("engine")
    lora = bool(root.data.get("loraAdapters")) or (isinstance(engine_data, dict)
                                                    and engine_data.get("enableLora") is True)
    problems += _model_uri_problems(model, lora)
    if model.source == "uri" and model.uri is None:
        problems.append("spec.model.uri is required when spec.model.source is uri")
    if model.source == "pvc" and model.pvc_claim is None:
        problems.append("spec.model.pvc.claimName is required when spec.model.source is pvc")

    g = root.sub("gpu")
    tolerations = g.get("tolerations") or []
    gpu = GPUSpec(count=g.get("count"), resource_name=g.get("resourceName"),
                  node_selector=dict(g.get("nodeSelector") or {}),
                  tolerations=tuple(t for t in tolerations if isinstance(t, dict)))
    if len(gpu.tolerations) != len(tolerations):
        problems.append("spec.gpu.tolerations items must be objects")

    res = root.sub("resources")
    resources = {k: dict(res.get(k)) for k in ("requests", "limits") if res.get(k)}

    e = root.sub("engine")
    nc = e.sub("nccl")
    gpus = gpu.count if isinstance(gpu.count, int) else 0
    tp = e.get("tensorParallelSize")
    tp_size = tp if isinstance(tp, int) else max(gpus, 1)
    engine = EngineSpec(
        max_num_seqs=e.get("maxNumSeqs"), max_num_batched_tokens=e.get("maxNumBatchedTokens"),
        block_size=e.get("blockSize"), kv_cache_memory_fraction=e.get("kvCacheMemoryFraction"),
        scheduling_policy=e.get("schedulingPolicy"), enable_prefix_caching=e.get("enablePrefixCaching"),
        preemption_mode=e.get("preemptionMode"), runtime=e.get("runtime"), tensor_parallel_size=tp_size,
        shared_memory_size=e.get("sharedMemorySize") or ("8Gi" if tp_size > 1 else "2Gi"),
        nccl=NCCLSpec(socket_ifname=nc.get("socketIfname"), debug=nc.get("debug")),
        enable_lora=e.get("enableLora"), max_loras=e.get("maxLoras"), max_lora_rank=e.get("maxLoraRank"),
        max_cpu_loras=e.get("maxCpuLoras"), speculative_config=_speculative(e, problems),
        openmp_wait_policy=e.get("openmpWaitPolicy"), kv_cache_dtype=e.get("kvCacheDtype"))
    if (isinstance(engine.max_cpu_loras, int) and isinstance(engine.max_loras, int)
            and engine.max_cpu_loras < engine.max_loras):
        problems.append(f"spec.engine.maxCpuLoras ({engine.max_cpu_loras}) must be at least spec.engine.maxLoras "
                        f"({engine.max_loras}): the adapters of one batch are all in host memory")
    if (isinstance(engine.max_num_seqs, int) and isinstance(engine.max_num_batched_tokens, int)
            and engine.max_num_batched_tokens < engine.max_num_seqs):
        problems.append(f"spec.engine.maxNumBatchedTokens ({engine.max_num_batched_tokens}) must be at least "
                        f"spec.engine.maxNumSeqs ({engine.max_num_seqs}): raise it or lower maxNumSeqs")
    if isinstance(tp, int) and tp > 1 and gpus == 0:
        problems.append(f"spec.engine.tensorParallelSize {tp} needs GPUs: set spec.gpu.count to a multiple of it "
                        f"(or tensorParallelSize 1 on CPU)")
    elif isinstance(tp, int) and gpus > 0 and gpus % tp:
        problems.append(f"spec.engine.tensorParallelSize ({tp}) must divide spec.gpu.count ({gpus}): each engine "
                        f"pod runs gpu.count / tensorParallelSize model replicas of {tp} GPUs")
    vllm = engine.runtime == "vllm"
    draft = engine.speculative_config is not None and engine.speculative_config.method == "draft_model"
    if vllm and engine.speculative_config is not None and engine.speculative_config.disable_by_batch_size:
        problems.append("spec.engine.speculativeConfig.disableByBatchSize is kvmesh-only: vLLM's speculative "
                        "config has no such key (leave it out with runtime vllm)")
    if draft and not vllm and tp_size > 1:
        problems.append(f"spec.engine.speculativeConfig method draft_model needs tensorParallelSize 1 with runtime "
                        f"kvmesh (the engine runs the draft unsharded), got {tp_size}: set "
                        f"spec.engine.tensorParallelSize 1 or use method ngram")
    if vllm and engine.scheduling_policy in ("sjf", "dynamic"):
        problems.append(f"spec.engine.schedulingPolicy {engine.scheduling_policy} is kvmesh-only: runtime vllm "
                        f"takes fcfs or priority")
    if vllm and engine.preemption_mode in ("swap", "auto"):
        problems.append(f"spec.engine.preemptionMode {engine.preemption_mode} is kvmesh-only: runtime vllm "
                        f"recomputes (use recompute)")

    r = root.sub("router")
    p = r.sub("inferencePool")
    router = RouterSpec(
        enabled=r.get("enabled"), strategy=r.get("strategy"), replicas=r.get("replicas"), mode=r.get("mode"),
        image=r.get("image") or (S.DEFAULT_IMAGE if vllm else root.get("image") or S.DEFAULT_IMAGE),
        cache_salt_from=r.get("cacheSaltFrom"), expose_route_headers=r.get("exposeRouteHeaders"),
        inference_pool=InferencePoolSpec(endpoint_picker_image=p.get("endpointPickerImage"),
                                         failure_mode=p.get("failureMode"), replicas=p.get("replicas")))
    pool = router.mode == "inference-pool"
    if pool and model.source != "pvc":
        problems.append("spec.router.mode inference-pool needs spec.model.source pvc: the endpoint picker reads "
                        "the model's tokenizer.json from the claim")
    if pool and model.tokenizer is not None and not model.tokenizer.startswith("/models/"):
        problems.append(f"spec.model.tokenizer {model.tokenizer!r} must be under /models with router.mode "
                        f"inference-pool: the endpoint picker mounts only the model claim")
    if pool and router.enabled is False:
        problems.append("spec.router.mode inference-pool needs spec.router.enabled (the endpoint picker is the "
                        "router): remove enabled: false, or use mode builtin")
    if pool and router.expose_route_headers:
        problems.append("spec.router.exposeRouteHeaders is a kvmesh router flag: router.mode inference-pool has "
                        "no kvmesh router")
    if vllm and router.cache_salt_from not in (None, "none"):
        problems.append("spec.router.cacheSaltFrom needs runtime kvmesh: vLLM engines do not salt their blocks "
                        "per tenant, so the router's salted lookups would never match")
    if (vllm or pool) and engine.enable_prefix_caching is False:
        problems.append("spec.engine.enablePrefixCaching must stay true with runtime vllm or router.mode "
                        "inference-pool: the router learns the engines' blocks from their KV events")
    if vllm and root.get("image") is None:
        problems.append("spec.image is required with spec.engine.runtime vllm: a vLLM image with `vllm serve`, "
                        "e.g. vllm/vllm-openai:v0.11.0")
    if vllm and gpus == 0 and isinstance(engine.block_size, int) and engine.block_size % 32:
        problems.append(f"spec.engine.blockSize {engine.block_size} does not suit runtime vllm on CPU: vLLM's CPU "
                        f"build takes multiples of 32 only (use 32 or 64, or GPUs)")
    if vllm and (model.uri or "").startswith(("s3://", "hf://")):
        problems.append("spec.engine.runtime vllm needs a spec.model.uri inside the image: s3:// and hf:// "
                        "models are fetched for runtime kvmesh")
    if vllm and model.source == "builtin":
        problems.append("spec.engine.runtime vllm needs spec.model.source uri or pvc: the built-in model ships in "
                        "kvmesh's image only")

    rd = root.sub("redis")
    ca_bundle = None
    if rd.has("caBundle"):
        ca = rd.sub("caBundle")
        sources = [(kind, ca.get(field)) for kind, field in (("ConfigMap", "configMap"), ("Secret", "secret"))
                   if ca.has(field)]
        if len(sources) != 1:
            problems.append("spec.redis.caBundle needs exactly one of configMap or secret")
        else:
            ca_bundle = CABundleRef(kind=sources[0][0], name=sources[0][1], key=ca.get("key"))
    redis = RedisSpec(url=rd.get("url"), password_secret=_secret(rd, "passwordSecret"), image=rd.get("image"),
                      ca_bundle=ca_bundle)
    if redis.ca_bundle is not None and not (redis.url or "").startswith("rediss://"):
        problems.append("spec.redis.caBundle needs a rediss:// spec.redis.url (TLS)")
    if redis.password_secret is not None and redis.url is None:
        problems.append("spec.redis.passwordSecret needs spec.redis.url (the managed Redis gets a generated "
                        "password)")

    a = root.sub("autoscaling")
    autoscaling = AutoscalingSpec(
        enabled=a.get("enabled"), mode=a.get("mode"), min_replicas=a.get("minReplicas"),
        max_replicas=a.get("maxReplicas"), target_waiting_requests=a.get("targetWaitingRequests"),
        cooldown_seconds=a.get("cooldownSeconds"), prometheus_address=a.get("prometheusAddress"),
        scale_to_zero_after_seconds=a.get("scaleToZeroAfterSeconds"), hold_timeout_seconds=a.get("holdTimeoutSeconds"))
    if (isinstance(autoscaling.min_replicas, int) and isinstance(autoscaling.max_replicas, int)
            and autoscaling.min_replicas > autoscaling.max_replicas):
        problems.append(f"spec.autoscaling.minReplicas ({autoscaling.min_replicas}) must not exceed "
                        f"spec.autoscaling.maxReplicas ({autoscaling.max_replicas})")
    if autoscaling.min_replicas == 0 and autoscaling.mode == "hpa":
        problems.append("spec.autoscaling.minReplicas 0 needs mode operator or keda (an HPA does not scale to zero)")
    if autoscaling.enabled and autoscaling.min_replicas == 0 and not router.builtin:
        problems.append("spec.autoscaling.minReplicas 0 needs kvmesh's router (spec.router.enabled, mode builtin): "
                        "it holds the requests that wake the engines")
    if autoscaling.mode == "keda" and autoscaling.prometheus_address is None:
        problems.append("spec.autoscaling.prometheusAddress is required when spec.autoscaling.mode is keda")

    t = root.sub("tracing")
    tracing = TracingSpec(otlp_endpoint=t.get("otlpEndpoint"), sampling_ratio=t.get("samplingRatio"),
                          protocol=t.get("protocol"))

    i = root.sub("ingress")
    ingress = IngressSpec(enabled=i.get("enabled"), class_name=i.get("className"), host=i.get("host"),
                          tls_secret=i.get("tlsSecretName"), annotations=dict(i.get("annotations") or {}))
    snippets = sorted(k for k in ingress.annotations if re.search(S.SNIPPET_ANNOTATION_PATTERN, k))
    if snippets:
        problems.append(f"spec.ingress.annotations {', '.join(snippets)}: configuration snippets are refused "
                        f"(they inject raw proxy configuration); use the controller's dedicated annotations")
    if ingress.tls_secret is not None and ingress.host is None:
        problems.append("spec.ingress.tlsSecretName needs spec.ingress.host (TLS is issued per host)")
    if pool and ingress.enabled:
        problems.append("spec.ingress.enabled does not apply to spec.router.mode inference-pool: route a Gateway "
                        "(HTTPRoute) to the InferencePool instead")
    admin_key = _secret(root, "adminApiKeySecret")
    if vllm and admin_key is not None:
        problems.append("spec.adminApiKeySecret is a kvmesh engine flag: runtime vllm has no admin key")

    adapters = _lora_adapters(root, model, problems)
    if vllm and (engine.enable_lora or adapters):
        problems.append("spec.engine.enableLora and spec.loraAdapters need runtime kvmesh: the operator loads "
                        "adapters through kvmesh's admin endpoints")
    disaggregation = _disaggregation(root, gpu, engine, router, autoscaling, problems)
    if disaggregation is not None:
        # NOTE: one GPU per engine pod whatever spec.gpu.count says (each role sets its own)
        engine = replace(engine, tensor_parallel_size=1)
    svc = InferenceService(
        name=name, namespace=namespace, model=model, image=root.get("image") or S.DEFAULT_IMAGE,
        image_pull_policy=root.get("imagePullPolicy"), replicas=root.get("replicas"), gpu=gpu,
        resources=resources, engine=engine, router=router, redis=redis, autoscaling=autoscaling,
        tracing=tracing, ingress=ingress, api_key_secret=_secret(root, "apiKeySecret"),
        admin_api_key_secret=admin_key, lora_adapters=adapters, disaggregation=disaggregation)
    if suffix := next((x for x in S.CHILD_SUFFIXES if name.endswith(x)), None):
        problems.append(f"metadata.name {name!r} must not end in {suffix!r}: it would collide with the children "
                        f"of InferenceService {name[:-len(suffix)]!r}; choose another name")
    if len(name) > 45:
        problems.append(f"metadata.name {name!r} is too long: at most 45 characters, so that child names "
                        f"like '<name>-engine-config' stay valid")
    if problems:
        raise SpecError(problems)
    return svc


def _lora_adapters(root: _Reader, model: ModelSpec, problems: list[str]) -> tuple[LoRAAdapterSpec, ...]:
    """spec.loraAdapters: names unique and not the model's, sources the engine pods can reach."""
    items = root.get("loraAdapters") or []
    item_schema = S.SPEC_SCHEMA["properties"]["loraAdapters"]["items"]
    out: list[LoRAAdapterSpec] = []
    for i, item in enumerate(items):
        a = _Reader(item, f"spec.loraAdapters[{i}]", problems, item_schema)
        name, source = a.get("name"), a.get("source")
        for key, value in (("name", name), ("source", source)):
            if value is None and isinstance(item, dict) and item.get(key) is None:
                problems.append(f"spec.loraAdapters[{i}].{key} is required")
        if name is None or source is None:
            continue
        if (problem := _lora_source_problem(f"spec.loraAdapters[{i}].source", source, model)) is not None:
            problems.append(problem)
        out.append(LoRAAdapterSpec(name, source))
    names = [a.name for a in out]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"spec.loraAdapters names must be unique: {', '.join(dup)} given more than once")
    if model.served_name in names:
        problems.append(f"spec.loraAdapters name {model.served_name!r} is the model's own name "
                        f"(spec.model.servedModelName): choose another")
    return tuple(out)


def _lora_source_problem(where: str, source: str, model: ModelSpec) -> str | None:
    if source.startswith("/"):
        return None
    if source.startswith("pvc://"):
        claim = source[len("pvc://"):].partition("/")[0]
        if model.source != "pvc" or claim != model.pvc_claim or not source[len("pvc://" + claim) + 1:]:
            return (f"{where} {source!r}: a pvc:// adapter must be a path on the model's claim "
                    f"(spec.model.source pvc, pvc://<spec.model.pvc.claimName>/path): the engine pods mount that "
                    f"claim only (or use an absolute path, s3:// or hf://)")
    elif not source.startswith(("s3://", "hf://")):
        kind = "a URL" if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", source) else "not an absolute path"
        return (f"{where} {source!r} is {kind}: it must be an absolute path (in the image or under /models), "
                f"pvc://claim/path, s3://bucket/prefix or hf://org/name[@revision]")
    try:
        parse_source(source)
    except FetchError as e:
        return f"{where} {e}"
    return None


def _role_autoscaling(role: str, a: _Reader, engine: EngineSpec, problems: list[str]) -> RoleAutoscalingSpec:
    """spec.disaggregation.<role>.autoscaling. NOTE: a decode role that sets no target scales on its
    running requests, one full batch (engine.maxNumSeqs) per pod: the schema cannot default one
    field on the absence of two others."""
    running = a.get("targetRunningRequests")
    waiting, kv = a.get("targetWaitingRequests"), a.get("targetKVCacheUsagePercent")
    if role == "decode" and running is None and waiting is None and kv is None:
        running = engine.max_num_seqs
    scaling = RoleAutoscalingSpec(enabled=a.get("enabled"), min_replicas=a.get("minReplicas"),
                                  max_replicas=a.get("maxReplicas"), target_waiting_requests=waiting,
                                  cooldown_seconds=a.get("cooldownSeconds"), mode=a.get("mode"),
                                  target_running_requests=running, target_kv_cache_usage_percent=kv,
                                  prometheus_address=a.get("prometheusAddress"))
    if scaling.mode == "keda" and scaling.prometheus_address is None:
        problems.append(f"spec.disaggregation.{role}.autoscaling.prometheusAddress is required when its mode "
                        f"is keda")
    return scaling


def _disaggregation(root: _Reader, gpu: GPUSpec, engine: EngineSpec, router: RouterSpec,
                    autoscaling: AutoscalingSpec, problems: list[str]) -> DisaggregationSpec | None:
    """spec.disaggregation, with the rules that tie it to the rest of the spec (the CRD's CEL rules)."""
    if not root.has("disaggregation"):
        return None
    d = root.sub("disaggregation")
    roles = []
    count = gpu.count if isinstance(gpu.count, int) else 0
    if count > 1 and not all(isinstance(d.data.get(role), dict) and d.data[role].get("gpus") is not None
                             for role in ("prefill", "decode")):
        problems.append(f"spec.disaggregation runs one GPU per engine pod: set spec.gpu.count ({count}) to 0 or 1, "
                        f"or spec.disaggregation.prefill.gpus and spec.disaggregation.decode.gpus")
    for role in ("prefill", "decode"):
        r = d.sub(role)
        a = r.sub("autoscaling")
        gpus = r.get("gpus")
        if gpus is None:
            gpus = min(count, 1)
        args = r.get("engineArgs") or []
        if not all(isinstance(x, str) for x in args):
            problems.append(f"spec.disaggregation.{role}.engineArgs items must be strings")
            args = []
        taken = sorted({f for x in args for f in S.OPERATOR_ENGINE_FLAGS if x == f or x.startswith(f + "=")})
        if taken:
            problems.append(f"spec.disaggregation.{role}.engineArgs must not set {', '.join(taken)}: the operator "
                            f"sets them")
        scaling = _role_autoscaling(role, a, engine, problems)
        if (isinstance(scaling.min_replicas, int) and isinstance(scaling.max_replicas, int)
                and scaling.min_replicas > scaling.max_replicas):
            problems.append(f"spec.disaggregation.{role}.autoscaling.minReplicas ({scaling.min_replicas}) must not "
                            f"exceed maxReplicas ({scaling.max_replicas})")
        roles.append(RoleSpec(role, r.get("replicas"), gpus, tuple(args), scaling))
    spec = DisaggregationSpec(protocol=d.get("protocol"), device_name=d.get("deviceName"),
                              prefill=roles[0], decode=roles[1])
    if spec.device_name is not None and spec.protocol != "rdma":
        problems.append("spec.disaggregation.deviceName needs spec.disaggregation.protocol rdma")
    if engine.runtime != "kvmesh":
        problems.append("spec.disaggregation needs spec.engine.runtime kvmesh: its engines take kvmesh's "
                        "--kv-transfer-config")
    if not router.builtin:
        problems.append("spec.disaggregation needs kvmesh's router (spec.router.enabled, mode builtin): it runs the "
                        "prefill and decode hops")
    if autoscaling.enabled:
        problems.append("spec.disaggregation scales each role on its own (spec.disaggregation.prefill.autoscaling, "
                        "spec.disaggregation.decode.autoscaling): leave spec.autoscaling disabled")
    engine_data = root.data.get("engine")
    tp = engine_data.get("tensorParallelSize") if isinstance(engine_data, dict) else None
    if isinstance(tp, int) and tp != 1:
        problems.append("spec.disaggregation needs spec.engine.tensorParallelSize 1: a KV transfer moves one "
                        "engine's cache")
    return spec
