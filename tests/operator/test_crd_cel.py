"""The CRD's CEL rules (x-kubernetes-validations) evaluated with cel-python the way the API server
runs them: on the defaulted object, at the node that declares them, only where that node exists.
They must agree with the operator's own validator (`crd.parse`) on every good and bad example."""
from __future__ import annotations

from typing import Any, Iterator

import celpy
import pytest

from kvmesh.operator import crd

from .examples import load_example
from .test_crd import CROSS_FIELD, _apply_defaults, _schema

_ENV = celpy.Environment()


def _rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, str]]:
    for r in schema.get("x-kubernetes-validations", []):
        yield path, r["rule"], r["message"]
    for key, prop in schema.get("properties", {}).items():
        yield from _rules(prop, (*path, key))


RULES = [(path, _ENV.program(_ENV.compile(rule)), message) for path, rule, message in _rules(_schema())]


def _node(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def failures(cr: dict[str, Any]) -> list[str]:
    """The messages of the rules the API server would reject `cr` with."""
    defaulted = _apply_defaults(_schema(), cr)
    out = []
    for path, program, message in RULES:
        node = _node(defaulted, path)
        if node is not None and not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
            out.append(message)
    return out


def _cr(spec: dict[str, Any], name: str = "x") -> dict[str, Any]:
    return {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def test_the_crd_declares_every_cross_field_rule() -> None:
    assert len(RULES) == 59


@pytest.mark.parametrize("spec", [
    load_example("minimal.yaml")["spec"],
    load_example("full.yaml")["spec"],
    load_example("vllm.yaml")["spec"],
    load_example("inference-pool.yaml")["spec"],
    {"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 2}},
    {"model": {}, "gpu": {"count": 0}, "engine": {"tensorParallelSize": 1}},
    {"model": {}, "gpu": {"count": 0}, "engine": {"kvCacheDtype": "fp8"}},
    {"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-cpu:v0.11.0", "gpu": {"count": 0},
     "engine": {"runtime": "vllm", "blockSize": 32}},
    {"model": {"source": "pvc", "pvc": {"claimName": "w"}, "tokenizer": "/models/tok"},
     "router": {"mode": "inference-pool"}},
    {"model": {"source": "uri", "uri": "/opt/models/m.gguf", "tokenizer": "/opt/models/tok"}},
    {"model": {}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 64}},
    {"model": {}, "autoscaling": {"minReplicas": 2, "maxReplicas": 2}},
    {"model": {"source": "uri", "uri": "s3://models/team/llama", "endpoint": "http://minio:9000",
               "credentials": {"secretName": "s3"}, "cache": {"hostPath": "/var/lib/kvmesh", "maxSize": "200G"}}},
    {"model": {"source": "uri", "uri": "hf://org/model@v1", "cache": {"claimName": "models"}}},
    {"model": {"source": "pvc", "pvc": {"claimName": "weights"}}, "engine": {"maxLoras": 4, "maxLoraRank": 64,
                                                                          "maxCpuLoras": 8},
     "loraAdapters": [{"name": "sql", "source": "pvc://weights/loras/sql"}, {"name": "chat.v2", "source": "s3://adapters/chat"},
                      {"name": "Hf_1", "source": "hf://org/lora@main"}, {"name": "img", "source": "/opt/loras/x"}]},
    {"model": {}, "engine": {"enableLora": True}, "loraAdapters": []},
    {"model": {"source": "uri", "uri": "/opt/models/m", "endpoint": "http://minio:9000",
               "credentials": {"secretName": "s3"}, "cache": {"hostPath": "/var/lib/kvmesh"}},
     "loraAdapters": [{"name": "sql", "source": "s3://adapters/sql"}]},
    {"model": {}, "gpu": {"count": 0}, "disaggregation": {
        "prefill": {"replicas": 2, "engineArgs": ["--max-num-batched-tokens", "4096"]},
        "decode": {"autoscaling": {"enabled": True, "maxReplicas": 8}}}},
    {"model": {}, "gpu": {"count": 8}, "disaggregation": {"protocol": "rdma", "deviceName": "mlx5_0",
                                                          "prefill": {"gpus": 1}, "decode": {"gpus": 1}}},
    {"model": {}, "engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 4,
                                                   "promptLookupMin": 2, "promptLookupMax": 4}}},
    {"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 1, "speculativeConfig": {
        "method": "draft_model", "numSpeculativeTokens": 3, "model": "/models/draft"}}},
    {"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0", "gpu": {"count": 2},
     "engine": {"runtime": "vllm", "speculativeConfig": {"method": "draft_model", "numSpeculativeTokens": 3,
                                                         "model": "/m/draft"}}},
    {"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-openai:v0.11.0", "gpu": {"count": 1},
     "engine": {"runtime": "vllm", "kvCacheDtype": "fp8"}},
    {"model": {}, "gpu": {"count": 1}, "engine": {"kvCacheDtype": "fp8_e5m2"}},
], ids=["minimal", "full", "vllm", "inference-pool", "tp-2-of-4", "tp-1-on-cpu", "fp8-kv-on-cpu", "vllm-cpu-block-32", "pool-tokenizer-on-pvc",
        "local-paths", "equal-seqs-and-tokens", "equal-min-max", "s3-model", "hf-model", "lora-adapters",
        "lora-enabled-without-adapters", "s3-adapters-with-the-models-credentials", "disaggregated-cpu",
        "disaggregated-rdma-one-gpu-each", "speculative-ngram",
        "speculative-draft-tp-1", "speculative-draft-vllm-tp-2", "fp8-kv-vllm-gpu", "fp8-kv-kvmesh-gpu"])
def test_good_specs_pass_every_rule(spec: dict[str, Any]) -> None:
    crd.parse("x", "ns", spec)                              # the operator agrees
    assert failures(_cr(spec)) == []


# The CEL messages each CROSS_FIELD example fails with, in the CRD's rule order; one per problem
# the operator reports (the operator's messages carry the values, the CRD's are fixed text).
CEL_MESSAGES = [
    ["model.uri is required when model.source is uri"],
    ["model.pvc is required when model.source is pvc"],
    ["engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"],
    ["autoscaling.minReplicas must not exceed autoscaling.maxReplicas"],
    ["autoscaling.prometheusAddress is required when autoscaling.mode is keda"],
    ["redis.passwordSecret needs redis.url (the managed Redis gets a generated password)"],
    ["ingress.tlsSecretName needs ingress.host"],
    ["ingress.annotations must not inject configuration snippets (*-snippet, *-snippets, config-backend…)"],
    ["redis.caBundle needs a rediss:// redis.url (TLS)"],
    ["redis.caBundle needs exactly one of configMap or secret"],
    ["model.uri must be an absolute path inside the image, s3://bucket/prefix or hf://org/name[@revision]"],
    ["engine.tensorParallelSize > 1 needs GPUs (gpu.count > 0)"],
    ["engine.tensorParallelSize must divide gpu.count"],
    ["engine.tensorParallelSize must divide gpu.count"],
    ["engine.schedulingPolicy sjf and dynamic are kvmesh-only; runtime vllm takes fcfs or priority",
     "engine.preemptionMode swap and auto are kvmesh-only; runtime vllm recomputes"],
    ["engine.blockSize must be 32 or 64 with runtime vllm on CPU (gpu.count 0): vLLM's CPU build takes "
     "multiples of 32 only"],
    ["spec.image is required with engine.runtime vllm (a vLLM image, e.g. vllm/vllm-openai:v0.11.0)",
     "engine.runtime vllm needs model.source uri or pvc (the built-in model ships in kvmesh's image)"],
    ["adminApiKeySecret is a kvmesh engine flag; runtime vllm has no admin key",
     "router.cacheSaltFrom needs runtime kvmesh (vLLM engines do not salt their blocks per tenant)",
     "engine.enablePrefixCaching must stay true with runtime vllm or router.mode inference-pool (the router "
     "learns the engines' blocks from their KV events)"],
    ["router.mode inference-pool needs model.source pvc (the endpoint picker reads the tokenizer from the claim)",
     "model.tokenizer must be under /models with router.mode inference-pool (the endpoint picker mounts only "
     "the model claim)",
     "ingress.enabled does not apply to router.mode inference-pool: route a Gateway (HTTPRoute) to the "
     "InferencePool instead",
     "router.mode inference-pool needs router.enabled (the endpoint picker is the router)",
     "router.exposeRouteHeaders is a kvmesh router flag; router.mode inference-pool has none"],
    ["model.uri must be an absolute path inside the image, s3://bucket/prefix or hf://org/name[@revision]",
     "model.tokenizer must be an absolute path (inside the image or under /models); Hugging Face ids and URLs "
     "are not downloaded"],
    ["model.uri must be an absolute path inside the image, s3://bucket/prefix or hf://org/name[@revision]"],
    ["model.credentials, model.endpoint and model.cache apply to an s3:// or hf:// model.uri, or to LoRA adapters "
     "(engine.enableLora, loraAdapters)",
     "model.cache takes hostPath or claimName, not both"],
    ["engine.runtime vllm needs a model.uri inside the image: s3:// and hf:// models are fetched for runtime "
     "kvmesh"],
    ["engine.maxCpuLoras must be at least engine.maxLoras"],
    ["loraAdapters names must be unique"],
    ["loraAdapters[].source must be an absolute path, pvc://claim/path, s3://bucket/prefix or "
     "hf://org/name[@revision]"],
    ["loraAdapters names must differ from model.servedModelName"],
    ["a pvc:// loraAdapters source must be a path on the model's claim (model.source pvc, "
     "pvc://<model.pvc.claimName>/path): the engine pods mount that claim only"],
    ["engine.enableLora and loraAdapters need runtime kvmesh (the operator loads adapters through kvmesh's admin "
     "endpoints)"],
    ["disaggregation.deviceName needs disaggregation.protocol rdma"],
    ["disaggregation needs engine.runtime kvmesh (its engines take kvmesh's --kv-transfer-config)"],
    ["disaggregation needs kvmesh's router (router.enabled, mode builtin): it runs the two hops"],
    ["disaggregation scales each role on its own (disaggregation.prefill.autoscaling, "
     "disaggregation.decode.autoscaling): leave spec.autoscaling disabled"],
    ["disaggregation needs engine.tensorParallelSize 1 (a KV transfer moves one engine's cache)",
     "disaggregation runs one GPU per engine pod: set gpu.count to 0 or 1, or each role's gpus"],
    ["engineArgs must not set --kv-transfer-config, --config, --host, --port, --pod-id, --redis-url: the "
     "operator sets them"],
    ["disaggregation.prefill.autoscaling.minReplicas must not exceed maxReplicas",
     "disaggregation.decode.autoscaling.minReplicas must not exceed maxReplicas"],
    ["disaggregation.prefill.autoscaling.prometheusAddress is required when its mode is keda",
     "disaggregation.decode.autoscaling.prometheusAddress is required when its mode is keda"],
    ["engine.speculativeConfig.model is required with method draft_model"],
    ["engine.speculativeConfig.model applies to method draft_model only"],
    ["engine.speculativeConfig.promptLookupMin / promptLookupMax apply to method ngram only"],
    ["engine.speculativeConfig.promptLookupMin must not exceed promptLookupMax"],
    ["engine.speculativeConfig method draft_model needs tensorParallelSize 1 with runtime kvmesh"],
    ["engine.speculativeConfig.disableByBatchSize is kvmesh-only; vLLM's speculative config has no such key"],
]


def test_every_cross_field_example_has_its_cel_messages() -> None:
    assert len(CEL_MESSAGES) == len(CROSS_FIELD)


@pytest.mark.parametrize(("spec", "problems", "messages"),
                         [(spec, problems, messages)
                          for (spec, problems), messages in zip(CROSS_FIELD, CEL_MESSAGES)])
def test_bad_specs_fail_the_rules_of_the_problems_the_operator_reports(
        spec: dict[str, Any], problems: list[str], messages: list[str]) -> None:
    assert len(messages) == len(problems) >= 1
    assert failures(_cr(spec)) == messages


def test_a_long_name_fails_the_name_rule_alone() -> None:
    (message,) = failures(_cr({"model": {}}, name="x" * 46))
    assert "45" in message
    assert failures(_cr({"model": {}}, name="x" * 45)) == []


def test_child_like_names_fail_the_suffix_rule_alone() -> None:
    (message,) = failures(_cr({"model": {}}, name="foo-engine"))
    assert "collide" in message
    assert failures(_cr({"model": {}}, name="foo-engines")) == []


def test_redis_url_schemes_are_limited_by_a_rule_too() -> None:
    assert failures(_cr({"model": {}, "redis": {"url": "unix:///run/redis.sock"}})) == [
        "redis.url must start with redis:// or rediss:// (no unix sockets or other schemes)"]
    assert failures(_cr({"model": {}, "redis": {"url": "rediss://r:6380/0"}})) == []


def test_every_rule_rejects_some_example() -> None:
    seen = {m for spec, _ in CROSS_FIELD for m in failures(_cr(spec))}
    seen |= set(failures(_cr({"model": {}}, name="x" * 46)))
    seen |= set(failures(_cr({"model": {}}, name="foo-redis")))
    seen |= set(failures(_cr({"model": {}, "redis": {"url": "unix:///run/redis.sock"}})))
    seen |= set(failures(_cr({"model": {}, "autoscaling": {"mode": "hpa", "minReplicas": 0}})))
    seen |= set(failures(_cr({"model": {}, "router": {"enabled": False},
                              "autoscaling": {"enabled": True, "minReplicas": 0}})))
    assert seen == {message for _, _, message in RULES}


def test_tensor_parallel_rules_name_the_problem() -> None:
    assert failures(_cr({"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 3}})) == [
        "engine.tensorParallelSize must divide gpu.count"]
    assert failures(_cr({"model": {}, "gpu": {"count": 2}, "engine": {"tensorParallelSize": 4}})) == [
        "engine.tensorParallelSize must divide gpu.count"]
    assert failures(_cr({"model": {}, "gpu": {"count": 0}, "engine": {"tensorParallelSize": 2}})) == [
        "engine.tensorParallelSize > 1 needs GPUs (gpu.count > 0)"]
    for count, size in ((8, 8), (8, 4), (8, 2), (8, 1), (1, 1), (6, 3)):
        assert failures(_cr({"model": {}, "gpu": {"count": count}, "engine": {"tensorParallelSize": size}})) == []


def test_vllm_runtime_needs_an_image_after_defaulting() -> None:
    """spec.image has no schema default: with runtime vllm the API server refuses a spec without one."""
    spec = {"model": {"source": "uri", "uri": "/m"}, "engine": {"runtime": "vllm"}}
    assert failures(_cr(spec)) == [
        "spec.image is required with engine.runtime vllm (a vLLM image, e.g. vllm/vllm-openai:v0.11.0)"]
    assert failures(_cr({**spec, "image": "vllm/vllm-openai:v0.11.0"})) == []
