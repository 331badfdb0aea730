"""Spec parsing and validation: defaults equal the CRD's, every bad field gets a clear message, and
the Python validator agrees with the CRD's openAPIV3Schema on good and bad examples."""
from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from kvmesh.operator import crd
from kvmesh.operator.schema import SPEC_SCHEMA, crd_manifest

from .examples import load_example


def _schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _schema_errors(cr: dict[str, Any]) -> list[str]:
    return [e.message for e in jsonschema.Draft4Validator(_schema()).iter_errors(cr)]


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's defaulting does (for comparison with the parser's defaults)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, prop in schema.get("properties", {}).items():
        if key not in out and "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
        if key in out:
            out[key] = _apply_defaults(prop, out[key])
    return out


def test_minimal_spec_gets_the_schema_defaults() -> None:
    svc = crd.parse("smol", "ns", {"model": {}})
    defaulted = _apply_defaults(SPEC_SCHEMA, {"model": {}})
    assert defaulted["engine"] == {"maxNumSeqs": 256, "maxNumBatchedTokens": 8192, "blockSize": 16,
                                   "kvCacheMemoryFraction": 0.9, "schedulingPolicy": "fcfs",
                                   "enablePrefixCaching": True, "preemptionMode": "recompute",
                                   "runtime": "kvmesh", "nccl": {"debug": "WARN"},
                                   "enableLora": False, "maxLoras": 1, "maxLoraRank": 16,
                                   "openmpWaitPolicy": "auto", "kvCacheDtype": "auto"}
    assert defaulted["router"] == {"enabled": True, "strategy": "kv-aware", "replicas": 1, "mode": "builtin",
                                   "cacheSaltFrom": "none", "exposeRouteHeaders": False, "inferencePool": {
                                       "endpointPickerImage": "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0",
                                       "failureMode": "FailClose", "replicas": 1}}
    assert "image" not in defaulted  # the engine image defaults by runtime (required with vllm)
    # the server-defaulted spec parses to exactly the same object
    assert crd.parse("smol", "ns", defaulted) == svc
    assert svc.engine == crd.EngineSpec(256, 8192, 16, 0.9, "fcfs", True, "recompute", "kvmesh", 1, "2Gi",
                                        crd.NCCLSpec(None, "WARN"))
    assert svc.model == crd.ModelSpec("builtin", None, None, "", "smol", None)
    assert svc.router == crd.RouterSpec(True, "kv-aware", 1, "builtin", "ghcr.io/kvmesh/kvmesh:0.1.0", "none", False,
                                        crd.InferencePoolSpec("ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0",
                                                              "FailClose", 1))
    assert svc.admin_api_key_secret is None and not svc.kv_events
    assert svc.redis.managed and svc.redis.image == "redis:7.4.1-alpine"
    assert svc.autoscaling == crd.AutoscalingSpec(False, "operator", 1, 4, 4, 300, None)
    assert svc.gpu == crd.GPUSpec(1, "nvidia.com/gpu", {}, ())
    assert svc.tracing == crd.TracingSpec(None, 0.1, "grpc")
    assert (svc.image, svc.replicas, svc.api_key_secret) == ("ghcr.io/kvmesh/kvmesh:0.1.0", 1, None)


def test_full_example_parses_every_field() -> None:
    cr = load_example("full.yaml")
    svc = crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])
    assert svc.model == crd.ModelSpec("pvc", "/opt/models/Llama-3.1-8B-Instruct", "llama-weights",
                                      "Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct",
                                      "/models/tokenizers/Llama-3.1-8B-Instruct")
    assert svc.gpu.count == 2 and svc.gpu.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert svc.engine == crd.EngineSpec(128, 16384, 32, 0.85, "priority", False, "swap", "kvmesh", 2, "16Gi",
                                        crd.NCCLSpec("eth0", "WARN"))
    assert svc.router == crd.RouterSpec(True, "kv-aware", 2, "builtin", "ghcr.io/kvmesh/kvmesh:0.1.0", "api-key",
                                        False, crd.InferencePoolSpec(
                                            "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0", "FailClose", 1))
    assert svc.admin_api_key_secret == crd.SecretRef("kvmesh-admin-key", "admin-api-key")
    assert svc.redis == crd.RedisSpec("rediss://redis.infra.svc:6380/2", crd.SecretRef("redis-auth", "password"),
                                      "redis:7.4.1-alpine", crd.CABundleRef("ConfigMap", "redis-ca", "ca.crt"))
    assert svc.autoscaling == crd.AutoscalingSpec(True, "keda", 2, 8, 6, 120, "http://prometheus.monitoring:9090")
    assert svc.tracing == crd.TracingSpec("http://otel-collector.observability:4317", 0.25, "grpc")
    assert svc.ingress == crd.IngressSpec(True, "nginx", "llama.example.com", "llama-tls",
                                          {"cert-manager.io/cluster-issuer": "letsencrypt"})
    assert svc.api_key_secret == crd.SecretRef("kvmesh-api-key", "api-key")


@pytest.mark.parametrize("example", ["minimal.yaml", "full.yaml", "vllm.yaml", "inference-pool.yaml",
                                     "s3-model.yaml", "disaggregated.yaml"])
def test_good_examples_pass_the_crd_schema(example: str) -> None:
    assert _schema_errors(load_example(example)) == []


def test_s3_example_parses_its_fetch_fields() -> None:
    cr = load_example("s3-model.yaml")
    m = crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"]).model
    assert (m.remote, m.uri, m.endpoint) == (True, "s3://models/Qwen2.5-0.5B-Instruct", "http://minio.storage.svc:9000")
    assert m.credentials == crd.FetchCredentials("minio-models", (
        ("AWS_ACCESS_KEY_ID", "accesskey"), ("AWS_SECRET_ACCESS_KEY", "secretkey"),
        ("AWS_SESSION_TOKEN", "AWS_SESSION_TOKEN"), ("HF_TOKEN", "HF_TOKEN")))
    assert m.cache == crd.ModelCacheSpec("/var/lib/kvmesh/models", None, "200G")
    assert crd.parse("x", "ns", {"model": {"source": "uri", "uri": "/opt/m"}}).model.remote is False


BAD = [
    ({"model": {"source": "s3"}}, "spec.model.source must be one of builtin, uri, pvc, got 's3'", "'s3' is not one of"),
    ({"model": {}, "replicas": -1}, "spec.replicas must be >= 0, got -1", "-1 is less than the minimum of 0"),
    ({"model": {}, "engine": {"blockSize": 12}}, "spec.engine.blockSize must be one of 8, 16, 32, 64, got 12",
     "12 is not one of"),
    ({"model": {}, "engine": {"kvCacheMemoryFraction": 0}}, "spec.engine.kvCacheMemoryFraction must be > 0, got 0",
     "0 is less than or equal to the minimum of 0"),
    ({"model": {}, "engine": {"enablePrefixCaching": "yes"}}, "spec.engine.enablePrefixCaching must be true or false",
     "'yes' is not of type 'boolean'"),
    ({"model": {}, "router": {"strategy": "sticky"}},
     "spec.router.strategy must be one of kv-aware, round-robin, least-loaded, random, got 'sticky'", "'sticky' is not one of"),
    ({"model": {}, "redis": {"url": "http://redis:6379"}},
     "spec.redis.url 'http://redis:6379' does not match ^rediss?://.+", "does not match"),
    ({"model": {}, "redis": {"url": "unix:///var/run/docker.sock"}},
     "spec.redis.url 'unix:///var/run/docker.sock' does not match ^rediss?://.+", "does not match"),
    ({"model": {}, "tracing": {"samplingRatio": 1.5}}, "spec.tracing.samplingRatio must be <= 1, got 1.5",
     "1.5 is greater than the maximum of 1"),
    ({"model": {}, "tracing": {"protocol": "http/json"}},
     "spec.tracing.protocol must be one of grpc, http/protobuf, got 'http/json'", "'http/json' is not one of"),
    ({"model": {}, "gpu": {"nodeSelector": {"gpu": True}}},
     "spec.gpu.nodeSelector values must be strings (quote numbers and booleans)", "True is not of type 'string'"),
    ({"model": {}, "apiKeySecret": {"key": "k"}}, "spec.apiKeySecret.name is required", "'name' is a required property"),
    ({"model": {}, "colour": "blue"}, "spec.colour is not a known field", None),
    ({"model": {"source": "uri", "uri": "s3://models/x", "cache": {"maxSize": "lots"}}},
     "spec.model.cache.maxSize 'lots' does not match ^[0-9]+(\\.[0-9]+)?([kKmMgGtT]i?)?$", "does not match"),
    ({"model": {"source": "uri", "uri": "s3://models/x", "endpoint": "minio:9000"}},
     "spec.model.endpoint 'minio:9000' does not match ^https?://.+", "does not match"),
]


@pytest.mark.parametrize(("spec", "message", "schema_message"), BAD, ids=[b[1][:40] for b in BAD])
def test_bad_specs_are_refused_by_both_validators(spec: dict[str, Any], message: str,
                                                  schema_message: str | None) -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", spec)
    assert err.value.problems[0].startswith(message)
    if schema_message is not None:  # unknown fields are pruned by the API server, not refused
        errors = _schema_errors({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                                 "metadata": {"name": "x"}, "spec": spec})
        assert any(schema_message in e for e in errors), errors


CROSS_FIELD = [  # CEL rules in the CRD (x-kubernetes-validations); jsonschema cannot run them
    ({"model": {"source": "uri"}}, ["spec.model.uri is required when spec.model.source is uri"]),
    ({"model": {"source": "pvc"}}, ["spec.model.pvc.claimName is required when spec.model.source is pvc"]),
    ({"model": {}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}},
     ["spec.engine.maxNumBatchedTokens (32) must be at least spec.engine.maxNumSeqs (64): raise it or lower maxNumSeqs"]),
    ({"model": {}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     ["spec.autoscaling.minReplicas (3) must not exceed spec.autoscaling.maxReplicas (2)"]),
    ({"model": {}, "autoscaling": {"mode": "keda"}},
     ["spec.autoscaling.prometheusAddress is required when spec.autoscaling.mode is keda"]),
    ({"model": {}, "redis": {"passwordSecret": {"name": "r"}}},
     ["spec.redis.passwordSecret needs spec.redis.url (the managed Redis gets a generated password)"]),
    ({"model": {}, "ingress": {"tlsSecretName": "t"}},
     ["spec.ingress.tlsSecretName needs spec.ingress.host (TLS is issued per host)"]),
    ({"model": {}, "ingress": {"enabled": True, "annotations": {
        "nginx.ingress.kubernetes.io/configuration-snippet": "more_set_headers x;",
        "nginx.org/server-snippets": "x", "haproxy-ingress.github.io/config-backend": "x",
        "nginx.ingress.kubernetes.io/proxy-body-size": "8m"}}},
     ["spec.ingress.annotations haproxy-ingress.github.io/config-backend, "
      "nginx.ingress.kubernetes.io/configuration-snippet, nginx.org/server-snippets: configuration snippets are "
      "refused (they inject raw proxy configuration); use the controller's dedicated annotations"]),
    ({"model": {}, "redis": {"url": "redis://r:6379/0", "caBundle": {"configMap": "ca"}}},
     ["spec.redis.caBundle needs a rediss:// spec.redis.url (TLS)"]),
    ({"model": {}, "redis": {"url": "rediss://r:6380/0", "caBundle": {"configMap": "ca", "secret": "ca"}}},
     ["spec.redis.caBundle needs exactly one of configMap or secret"]),
    ({"model": {"source": "uri", "uri": "HuggingFaceTB/SmolLM2-360M"}},
     ["spec.model.uri 'HuggingFaceTB/SmolLM2-360M' is not an absolute path: it must be an absolute path to an "
      "HF-format directory or a .gguf file inside the image, s3://bucket/prefix or hf://org/name[@revision] (or "
      "use source: pvc and a path under /models)"]),
    ({"model": {}, "gpu": {"count": 0}, "engine": {"tensorParallelSize": 2}},
     ["spec.engine.tensorParallelSize 2 needs GPUs: set spec.gpu.count to a multiple of it (or tensorParallelSize "
      "1 on CPU)"]),
    ({"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 3}},
     ["spec.engine.tensorParallelSize (3) must divide spec.gpu.count (4): each engine pod runs gpu.count / "
      "tensorParallelSize model replicas of 3 GPUs"]),
    ({"model": {}, "gpu": {"count": 2}, "engine": {"tensorParallelSize": 4}},
     ["spec.engine.tensorParallelSize (4) must divide spec.gpu.count (2): each engine pod runs gpu.count / "
      "tensorParallelSize model replicas of 4 GPUs"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0",
      "engine": {"runtime": "vllm", "schedulingPolicy": "sjf", "preemptionMode": "swap"}},
     ["spec.engine.schedulingPolicy sjf is kvmesh-only: runtime vllm takes fcfs or priority",
      "spec.engine.preemptionMode swap is kvmesh-only: runtime vllm recomputes (use recompute)"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0", "gpu": {"count": 0},
      "engine": {"runtime": "vllm", "blockSize": 16}},
     ["spec.engine.blockSize 16 does not suit runtime vllm on CPU: vLLM's CPU build takes multiples of 32 only "
      "(use 32 or 64, or GPUs)"]),
    ({"model": {}, "engine": {"runtime": "vllm"}},
     ["spec.image is required with spec.engine.runtime vllm: a vLLM image with `vllm serve`, e.g. "
      "vllm/vllm-openai:v0.11.0",
      "spec.engine.runtime vllm needs spec.model.source uri or pvc: the built-in model ships in kvmesh's image "
      "only"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0",
      "engine": {"runtime": "vllm", "enablePrefixCaching": False},
      "router": {"cacheSaltFrom": "api-key"}, "adminApiKeySecret": {"name": "admin"}},
     ["spec.router.cacheSaltFrom needs runtime kvmesh: vLLM engines do not salt their blocks per tenant, so the "
      "router's salted lookups would never match",
      "spec.engine.enablePrefixCaching must stay true with runtime vllm or router.mode inference-pool: the router "
      "learns the engines' blocks from their KV events",
      "spec.adminApiKeySecret is a kvmesh engine flag: runtime vllm has no admin key"]),
    ({"model": {"source": "uri", "uri": "/m", "tokenizer": "/opt/tok"},
      "router": {"mode": "inference-pool", "enabled": False, "exposeRouteHeaders": True},
      "ingress": {"enabled": True}},
     ["spec.router.mode inference-pool needs spec.model.source pvc: the endpoint picker reads the model's "
      "tokenizer.json from the claim",
      "spec.model.tokenizer '/opt/tok' must be under /models with router.mode inference-pool: the endpoint "
      "picker mounts only the model claim",
      "spec.router.mode inference-pool needs spec.router.enabled (the endpoint picker is the router): remove "
      "enabled: false, or use mode builtin",
      "spec.router.exposeRouteHeaders is a kvmesh router flag: router.mode inference-pool has no kvmesh router",
      "spec.ingress.enabled does not apply to spec.router.mode inference-pool: route a Gateway (HTTPRoute) to "
      "the InferencePool instead"]),
    ({"model": {"source": "uri", "uri": "https://huggingface.co/x/y", "tokenizer": "s3://bucket/tok"}},
     ["spec.model.uri 'https://huggingface.co/x/y' is a URL: it must be an absolute path to an HF-format "
      "directory or a .gguf file inside the image, s3://bucket/prefix or hf://org/name[@revision] (or use "
      "source: pvc and a path under /models)",
      "spec.model.tokenizer 's3://bucket/tok' is a URL: it must be an absolute path to a tokenizer directory; "
      "Hugging Face ids and URLs are not downloaded (bake the files into the image, or use source: pvc and a "
      "path under /models)"]),
    ({"model": {"source": "uri", "uri": "s3://No_Such/m"}},
     ["spec.model.uri s3://No_Such/m: 'No_Such' is not a valid bucket name; expected s3://bucket/prefix"]),
    ({"model": {"source": "uri", "uri": "/m", "endpoint": "http://minio:9000",
                "cache": {"hostPath": "/var/lib/kvmesh", "claimName": "models"}}},
     ["spec.model.cache takes hostPath or claimName, not both",
      "spec.model.endpoint, spec.model.cache: only for an s3:// or hf:// spec.model.uri (what the init "
      "container fetches) or LoRA adapters (what the engines fetch)"]),
    ({"model": {"source": "uri", "uri": "hf://org/model@v1"}, "image": "vllm/vllm-openai:v0.11.0",
      "engine": {"runtime": "vllm"}},
     ["spec.engine.runtime vllm needs a spec.model.uri inside the image: s3:// and hf:// models are fetched "
      "for runtime kvmesh"]),
    ({"model": {}, "engine": {"maxLoras": 4, "maxCpuLoras": 2}},
     ["spec.engine.maxCpuLoras (2) must be at least spec.engine.maxLoras (4): the adapters of one batch are all in "
      "host memory"]),
    ({"model": {}, "loraAdapters": [{"name": "sql", "source": "/a"}, {"name": "sql", "source": "/b"}]},
     ["spec.loraAdapters names must be unique: sql given more than once"]),
    ({"model": {}, "loraAdapters": [{"name": "sql", "source": "org/sql-lora"}]},
     ["spec.loraAdapters[0].source 'org/sql-lora' is not an absolute path: it must be an absolute path (in the "
      "image or under /models), pvc://claim/path, s3://bucket/prefix or hf://org/name[@revision]"]),
    ({"model": {"servedModelName": "base"}, "loraAdapters": [{"name": "base", "source": "/a"}]},
     ["spec.loraAdapters name 'base' is the model's own name (spec.model.servedModelName): choose another"]),
    ({"model": {"source": "pvc", "pvc": {"claimName": "weights"}},
      "loraAdapters": [{"name": "sql", "source": "pvc://adapters/sql"}]},
     ["spec.loraAdapters[0].source 'pvc://adapters/sql': a pvc:// adapter must be a path on the model's claim "
      "(spec.model.source pvc, pvc://<spec.model.pvc.claimName>/path): the engine pods mount that claim only (or "
      "use an absolute path, s3:// or hf://)"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0",
      "engine": {"runtime": "vllm", "enableLora": True}},
     ["spec.engine.enableLora and spec.loraAdapters need runtime kvmesh: the operator loads adapters through "
      "kvmesh's admin endpoints"]),
    # spec.disaggregation (issue 26)
    ({"model": {}, "disaggregation": {"deviceName": "mlx5_0"}},
     ["spec.disaggregation.deviceName needs spec.disaggregation.protocol rdma"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0", "engine": {"runtime": "vllm"},
      "disaggregation": {}},
     ["spec.disaggregation needs spec.engine.runtime kvmesh: its engines take kvmesh's --kv-transfer-config"]),
    ({"model": {}, "router": {"enabled": False}, "disaggregation": {}},
     ["spec.disaggregation needs kvmesh's router (spec.router.enabled, mode builtin): it runs the prefill and "
      "decode hops"]),
    ({"model": {}, "autoscaling": {"enabled": True}, "disaggregation": {}},
     ["spec.disaggregation scales each role on its own (spec.disaggregation.prefill.autoscaling, "
      "spec.disaggregation.decode.autoscaling): leave spec.autoscaling disabled"]),
    ({"model": {}, "gpu": {"count": 2}, "engine": {"tensorParallelSize": 2}, "disaggregation": {}},
     ["spec.disaggregation runs one GPU per engine pod: set spec.gpu.count (2) to 0 or 1, or "
      "spec.disaggregation.prefill.gpus and spec.disaggregation.decode.gpus",
      "spec.disaggregation needs spec.engine.tensorParallelSize 1: a KV transfer moves one engine's cache"]),
    ({"model": {}, "disaggregation": {"prefill": {"engineArgs": ["--max-num-seqs", "8", "--port=9"]}}},
     ["spec.disaggregation.prefill.engineArgs must not set --port: the operator sets them"]),
    ({"model": {}, "disaggregation": {"prefill": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
                                      "decode": {"autoscaling": {"minReplicas": 5}}}},
     ["spec.disaggregation.prefill.autoscaling.minReplicas (3) must not exceed maxReplicas (2)",
      "spec.disaggregation.decode.autoscaling.minReplicas (5) must not exceed maxReplicas (4)"]),
    ({"model": {}, "disaggregation": {"prefill": {"autoscaling": {"mode": "keda"}},
                                      "decode": {"autoscaling": {"enabled": True, "mode": "keda"}}}},
     ["spec.disaggregation.prefill.autoscaling.prometheusAddress is required when its mode is keda",
      "spec.disaggregation.decode.autoscaling.prometheusAddress is required when its mode is keda"]),
    ({"model": {}, "engine": {"speculativeConfig": {"method": "draft_model", "numSpeculativeTokens": 2}}},
     ["spec.engine.speculativeConfig: method 'draft_model' needs \"model\": the draft's HF directory"]),
    ({"model": {}, "engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 2, "model": "/d"}}},
     ["spec.engine.speculativeConfig: method 'ngram' takes no model (it looks up the request's own tokens)"]),
    ({"model": {}, "engine": {"speculativeConfig": {"method": "draft_model", "numSpeculativeTokens": 2,
                                                    "model": "/d", "promptLookupMax": 3}}},
     ["spec.engine.speculativeConfig: prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only"]),
    ({"model": {}, "engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 2,
                                                    "promptLookupMin": 3, "promptLookupMax": 2}}},
     ["spec.engine.speculativeConfig: prompt_lookup_min (3) must be <= prompt_lookup_max (2)"]),
    ({"model": {}, "gpu": {"count": 4}, "engine": {"speculativeConfig": {
        "method": "draft_model", "numSpeculativeTokens": 2, "model": "/models/draft"}}},
     ["spec.engine.speculativeConfig method draft_model needs tensorParallelSize 1 with runtime kvmesh (the engine "
      "runs the draft unsharded), got 4: set spec.engine.tensorParallelSize 1 or use method ngram"]),
    ({"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0", "engine": {
        "runtime": "vllm", "speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 2,
                                                 "disableByBatchSize": 8}}},
     ["spec.engine.speculativeConfig.disableByBatchSize is kvmesh-only: vLLM's speculative config has no such "
      "key (leave it out with runtime vllm)"]),
]


def test_an_unknown_kv_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", {"model": {}, "engine": {"kvCacheDtype": "int8"}})
    assert err.value.problems == ["spec.engine.kvCacheDtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, "
                                  "got 'int8'"]


@pytest.mark.parametrize(("spec", "problems"), CROSS_FIELD)
def test_cross_field_rules(spec: dict[str, Any], problems: list[str]) -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", spec)
    assert err.value.problems == problems


def test_tensor_parallel_size_defaults_to_the_gpus_of_a_pod() -> None:
    def tp(spec: dict[str, Any]) -> tuple[int, str]:
        engine = crd.parse("x", "ns", {"model": {}, **spec}).engine
        return engine.tensor_parallel_size, engine.shared_memory_size
    assert tp({}) == (1, "2Gi")
    assert tp({"gpu": {"count": 4}}) == (4, "8Gi")
    assert tp({"gpu": {"count": 0}}) == (1, "2Gi")  # CPU
    assert tp({"gpu": {"count": 4}, "engine": {"tensorParallelSize": 2}}) == (2, "8Gi")
    assert tp({"gpu": {"count": 4}, "engine": {"tensorParallelSize": 1}}) == (1, "2Gi")
    assert tp({"gpu": {"count": 2}, "engine": {"sharedMemorySize": "20Gi"}}) == (2, "20Gi")
    assert tp({"gpu": {"count": 0}, "engine": {"tensorParallelSize": 1}}) == (1, "2Gi")


@pytest.mark.parametrize(("value", "ok"), [("none", True), ("api-key", True), ("header:X-Tenant-Id", True),
                                           ("header:", False), ("cookie:x", False), ("header:a b", False)])
def test_cache_salt_from_takes_the_router_flags_values(value: str, ok: bool) -> None:
    spec = {"model": {}, "router": {"cacheSaltFrom": value}}
    if ok:
        assert crd.parse("x", "ns", spec).router.cache_salt_from == value
        assert _schema_errors({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
                               "metadata": {"name": "x"}, "spec": spec}) == []
    else:
        with pytest.raises(crd.SpecError, match="spec.router.cacheSaltFrom"):
            crd.parse("x", "ns", spec)


def test_runtime_vllm_and_router_images() -> None:
    vllm = crd.parse("x", "ns", {"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0",
                                 "engine": {"runtime": "vllm"}})
    assert (vllm.image, vllm.router.image) == ("vllm/vllm-openai:v0.11.0", "ghcr.io/kvmesh/kvmesh:0.1.0")
    assert vllm.kv_events and vllm.router.builtin
    own = crd.parse("x", "ns", {"model": {}, "image": "registry.example.com/kvmesh:1.2.3"})
    assert (own.image, own.router.image) == ("registry.example.com/kvmesh:1.2.3", "registry.example.com/kvmesh:1.2.3")
    pool = crd.parse("x", "ns", {"model": {"source": "pvc", "pvc": {"claimName": "w"}},
                                 "router": {"mode": "inference-pool"}})
    assert pool.kv_events and not pool.router.builtin


def test_local_paths_are_accepted() -> None:
    svc = crd.parse("x", "ns", {"model": {"source": "uri", "uri": "/opt/models/m.gguf",
                                          "tokenizer": "/opt/models/tok"}})
    assert (svc.model.uri, svc.model.tokenizer) == ("/opt/models/m.gguf", "/opt/models/tok")


def test_cross_field_rules_are_declared_in_the_crd() -> None:
    text = str(_schema())
    for rule in ("self.source != 'uri' || has(self.uri)", "self.maxNumBatchedTokens >= self.maxNumSeqs",
                 "!has(self.uri) || self.uri.startsWith('/')",
                 "!has(self.tokenizer) || self.tokenizer.startsWith('/')",
                 "self.minReplicas <= self.maxReplicas", "self.mode != 'keda' || has(self.prometheusAddress)",
                 "self.minReplicas > 0 || self.mode != 'hpa'",
                 "!has(self.passwordSecret) || has(self.url)", "!has(self.tlsSecretName) || has(self.host)",
                 "self.metadata.name.size() <= 45", "!self.metadata.name.endsWith('-engine')",
                 "self.url.startsWith('rediss://')", "self.annotations.all(k, !k.matches("):
        assert rule in text


@pytest.mark.parametrize("name", ["foo-engine", "foo-router", "foo-redis", "foo-epp"])
def test_names_that_collide_with_another_services_children_are_refused(name: str) -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse(name, "ns", {"model": {}})
    assert err.value.problems == [f"metadata.name {name!r} must not end in {name[3:]!r}: it would collide with "
                                  f"the children of InferenceService 'foo'; choose another name"]
    crd.parse("foo-engines", "ns", {"model": {}})  # only the exact suffixes


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x" * 46, "ns", {"replicas": "two", "engine": {"blockSize": 7}})
    assert err.value.problems == [
        "spec.model is required (use `model: {source: builtin}` for the bundled model)",
        "spec.engine.blockSize must be one of 8, 16, 32, 64, got 7",
        "spec.replicas must be an integer",
        "metadata.name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' is too long: at most 45 characters, so that "
        "child names like '<name>-engine-config' stay valid",
    ]


def test_printer_columns_read_what_status_writes() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    assert [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]] == [
        ("Model", ".status.model"), ("Replicas", ".status.replicas"), ("Ready", ".status.readyReplicas"),
        ("Phase", ".status.phase"), ("URL", ".status.url"), ("Age", ".metadata.creationTimestamp")]


def test_status_phase_enum_lists_every_phase_the_operator_sets() -> None:
    status = _schema()["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Progressing", "Ready", "Failed", "Terminating"]


def test_tracing_schema_says_engines_and_defaults_to_grpc() -> None:
    tracing = _schema()["properties"]["spec"]["properties"]["tracing"]
    assert tracing["description"] == "OpenTelemetry traces of the engines (the router does not trace)."
    assert tracing["properties"]["protocol"]["enum"] == ["grpc", "http/protobuf"]
    assert tracing["properties"]["protocol"]["default"] == "grpc"
