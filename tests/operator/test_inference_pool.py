"""router.mode inference-pool: the InferencePool (validated against upstream's vendored CRD: schema and
CEL rules), llm-d's endpoint picker and its configuration, and the pool's conditions in status."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kvmesh.operator import crd
from kvmesh.operator import inference_pool as IP
from kvmesh.operator import resources as R
from kvmesh.operator import status as S

from .examples import load_example

DATA = Path(__file__).parent / "data" / "inferencepool"
OWNER = R.Owner(name="smol-pool", uid="0b6c2f4e-1111-2222-3333-444455556666")
K8S_VERSION = "1.32.0"
ENGINE_SELECTOR = {"kvmesh.io/inference-service": "smol-pool", "app.kubernetes.io/component": "engine"}
NOW = "2026-01-01T00:00:00Z"


def _upstream_crd() -> dict[str, Any]:
    return yaml.safe_load((DATA / "inference.networking.k8s.io_inferencepools.yaml").read_text())


def _upstream_schema() -> dict[str, Any]:
    (version,) = [v for v in _upstream_crd()["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _cel_failures(schema: dict[str, Any], obj: Any) -> list[str]:
    """Every x-kubernetes-validations rule of `schema`, evaluated where its node exists in `obj`."""
    env, out = celpy.Environment(), []

    def walk(node_schema: dict[str, Any], value: Any) -> None:
        for rule in node_schema.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
                out.append(rule["message"])
        for key, prop in (node_schema.get("properties") or {}).items():
            if isinstance(value, dict) and key in value:
                walk(prop, value[key])
        if "items" in node_schema and isinstance(value, list):
            for item in value:
                walk(node_schema["items"], item)

    walk(schema, obj)
    return out


def _example() -> crd.InferenceService:
    cr = load_example("inference-pool.yaml")
    return crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])


def test_the_vendored_crd_is_upstreams_v1() -> None:
    doc = _upstream_crd()
    assert doc["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert doc["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    assert [v["name"] for v in doc["spec"]["versions"] if v["served"]] == ["v1"]
    assert "Apache License 2.0" in (DATA / "README.md").read_text()


def test_the_pool_selects_the_engines_and_names_the_picker() -> None:
    pool = IP.build_inference_pool(_example(), OWNER)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "smol-pool"
    assert pool["spec"] == {
        "selector": {"matchLabels": ENGINE_SELECTOR}, "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "smol-pool-epp", "port": {"number": 9002},
                              "failureMode": "FailOpen"}}


@pytest.mark.parametrize("failure_mode", ["FailOpen", "FailClose"])
def test_the_pool_is_valid_against_the_upstream_crd(failure_mode: str) -> None:
    svc = crd.parse("smol-pool", "llm", {"model": {"source": "pvc", "pvc": {"claimName": "w"}},
                                         "router": {"mode": "inference-pool",
                                                    "inferencePool": {"failureMode": failure_mode}}})
    pool = IP.build_inference_pool(svc, OWNER)
    schema = _upstream_schema()
    assert [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(pool)] == []
    assert _cel_failures(schema, pool) == []
    # the deployment's labels match the selector the pool uses
    engine = R.build_engine_deployment(svc, OWNER, 1)
    assert pool["spec"]["selector"]["matchLabels"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()


def test_the_upstream_rules_would_catch_a_broken_pool() -> None:
    """The validation above can fail: the vendored schema and rules reject what upstream rejects."""
    pool = IP.build_inference_pool(_example(), OWNER)
    schema = _upstream_schema()
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "x", "kind": "Service"}}}
    assert _cel_failures(schema, no_port) == ["port is required when kind is 'Service' or unspecified (defaults "
                                              "to 'Service')"]
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8000}]}}
    assert _cel_failures(schema, twice) == ["port number must be unique"]
    bad_mode = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {
        **pool["spec"]["endpointPickerRef"], "failureMode": "Retry"}}}
    assert [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(bad_mode)] == [
        "'Retry' is not one of ['FailOpen', 'FailClose']"]


def test_children_replace_kvmeshs_router_with_the_picker() -> None:
    svc = _example()
    children = R.build_children(svc, OWNER, 2)
    keys = [R.child_key(c) for c in children]
    assert keys == [
        ("networking.k8s.io/v1", "NetworkPolicy", "smol-pool-redis"), ("apps/v1", "Deployment", "smol-pool-redis"),
        ("v1", "Service", "smol-pool-redis"), ("v1", "ConfigMap", "smol-pool-engine-config"),
        ("v1", "Service", "smol-pool-engine"), ("apps/v1", "Deployment", "smol-pool-engine"),
        ("v1", "ServiceAccount", "smol-pool-epp"), ("rbac.authorization.k8s.io/v1", "Role", "smol-pool-epp"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", "smol-pool-epp"), ("v1", "ConfigMap", "smol-pool-epp-config"),
        ("apps/v1", "Deployment", "smol-pool-epp"), ("v1", "Service", "smol-pool-epp"),
        ("inference.networking.k8s.io/v1", "InferencePool", "smol-pool"), ("v1", "Service", "smol-pool")]
    assert set(keys) <= set(R.possible_children(svc))
    for obj in children:
        if obj["kind"] != "InferencePool":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # the front Service selects the engines (clients of the pool come through a Gateway)
    front = children[-1]
    assert front["spec"]["selector"] == ENGINE_SELECTOR and front["spec"]["ports"][0]["targetPort"] == 8000
    # kvmesh engines publish vLLM-format KV events for the picker, topic naming the pod as it scores it
    args = next(c for c in children if c["metadata"]["name"] == "smol-pool-engine"
                and c["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--kv-events-config",
                         '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
                         '"replay_endpoint":"tcp://*:5558","buffer_steps":10000,'
                         '"topic":"kv@$(POD_IP):8000@smol"}']


def test_vllm_engines_behind_a_pool_need_no_kvmesh_index() -> None:
    svc = crd.parse("q", "llm", {"model": {"source": "pvc", "pvc": {"claimName": "w", "path": "Q"}},
                                 "image": "vllm/vllm-openai:v0.11.0", "engine": {"runtime": "vllm"},
                                 "router": {"mode": "inference-pool"}})
    kinds = [R.child_key(c) for c in R.build_children(svc, OWNER, 1)]
    assert not [k for k in kinds if k[2] == "q-redis" or k[2] == "q-engine-config" or k[2] == "q-router"]
    assert (S.conditions(svc, {}, 1)[2]) == {"type": "RedisReady", "status": "True", "reason": "NotUsed",
                                             "message": "vLLM engines behind an InferencePool use no kvmesh index"}


def test_the_picker_configuration_follows_the_engines() -> None:
    svc = crd.parse("smol-pool", "llm", {"model": {"source": "pvc", "pvc": {"claimName": "w", "path": "m"},
                                                   "servedModelName": "smol"},
                                         "engine": {"blockSize": 32}, "router": {"mode": "inference-pool"}})
    cm = IP.build_epp_config_map(svc, OWNER)
    config = yaml.safe_load(cm["data"]["epp-config.yaml"])
    assert config == IP.epp_config(svc)
    assert (config["apiVersion"], config["kind"]) == ("inference.networking.x-k8s.io/v1alpha1",
                                                      "EndpointPickerConfig")
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    assert scorer["parameters"] == {
        "tokenProcessorConfig": {"blockSize": 32, "hashSeed": "42"},
        "kvEventsConfig": {"topicFilter": "kv@", "concurrency": 4, "discoverPods": True, "podDiscoveryConfig": {
            "podLabelSelector": "app.kubernetes.io/component=engine,kvmesh.io/inference-service=smol-pool",
            "podNamespace": "llm", "socketPort": 5557}},
        "indexerConfig": {"tokenizersPoolConfig": {"modelName": "smol", "local": {
            "modelTokenizerMap": {"smol": "/models/m/tokenizer.json"}}}, "kvBlockIndexConfig": {"enableMetrics": True}}}
    profile = config["schedulingProfiles"][0]["plugins"]
    assert {p["pluginRef"]: p.get("weight") for p in profile} == {
        "tokenizer": None, "precise-prefix-cache-scorer": 2.0, "kv-cache-utilization-scorer": 1.0,
        "queue-scorer": 1.0, "max-score-picker": None}
    declared = {p["type"] for p in config["plugins"]}
    referenced = {p["pluginRef"] for p in profile} | {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    assert referenced <= declared
    # a tokenizer directory of its own, on the claim
    other = crd.parse("smol-pool", "llm", {"model": {"source": "pvc", "pvc": {"claimName": "w"},
                                                     "tokenizer": "/models/tok/"},
                                           "router": {"mode": "inference-pool"}})
    assert IP.tokenizer_file(other) == "/models/tok/tokenizer.json"


def test_the_picker_deployment_service_and_rights() -> None:
    svc = _example()
    dep = IP.build_epp_deployment(svc, OWNER)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0"
    assert c["args"] == ["--pool-name", "smol-pool", "--pool-namespace", "llm", "--pool-group",
                         "inference.networking.k8s.io", "--config-file", "/config/epp-config.yaml",
                         "--grpc-port", "9002", "--grpc-health-port", "9003", "--metrics-port", "9090",
                         "--zap-encoder", "json"]
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert pod["serviceAccountName"] == "smol-pool-epp"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "smol-weights", "readOnly": True}} in pod["volumes"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    ha = crd.parse("smol-pool", "llm", {"model": {"source": "pvc", "pvc": {"claimName": "w"}},
                                        "router": {"mode": "inference-pool", "inferencePool": {"replicas": 2}}})
    ha_c = IP.build_epp_deployment(ha, OWNER)["spec"]["template"]["spec"]["containers"][0]
    assert ha_c["args"][-1] == "--ha-enable-leader-election"
    assert ha_c["readinessProbe"]["grpc"]["service"] == "readiness"
    svc_obj = IP.build_epp_service(svc, OWNER)
    assert svc_obj["spec"]["ports"][0] == {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc",
                                           "protocol": "TCP", "appProtocol": "http2"}
    role = IP.build_epp_role(svc, OWNER)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
         "verbs": ["get", "list", "watch"]}]
    binding = IP.build_epp_role_binding(svc, OWNER)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "smol-pool-epp", "namespace": "llm"}]


# ---- status -------------------------------------------------------------------------------------------
def _pool_status(*parents: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"parents": list(parents)}}


def _parent(name: str, accepted: str, resolved: str, reason: str = "Accepted") -> dict[str, Any]:
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name,
                          "namespace": "gw"},
            "conditions": [{"type": "Accepted", "status": accepted, "reason": reason, "message": "",
                            "lastTransitionTime": NOW, "observedGeneration": 1},
                           {"type": "ResolvedRefs", "status": resolved, "reason": "ResolvedRefs", "message": "",
                            "lastTransitionTime": NOW, "observedGeneration": 1}]}


POOL_KEY = ("inference.networking.k8s.io/v1", "InferencePool", "smol-pool")


@pytest.mark.parametrize(("pool", "forbidden", "expected"), [
    (None, set(), ("False", "InferencePoolMissing", "the InferencePool does not exist yet")),
    ({"status": {}}, set(), ("False", "NoParents",
                             "no Gateway has accepted InferencePool smol-pool yet: route an HTTPRoute to it")),
    (_pool_status(_parent("inference-gateway", "True", "True")), set(),
     ("True", "Accepted", "Gateway gw/inference-gateway: Accepted=True (Accepted), ResolvedRefs=True (ResolvedRefs)")),
    (_pool_status(_parent("a", "False", "True", "NotSupportedByGateway"), _parent("b", "True", "True")), set(),
     ("True", "Accepted", "Gateway gw/a: Accepted=False (NotSupportedByGateway), ResolvedRefs=True (ResolvedRefs); "
                          "Gateway gw/b: Accepted=True (Accepted), ResolvedRefs=True (ResolvedRefs)")),
    (_pool_status(_parent("a", "True", "False")), set(),
     ("False", "NotAccepted", "Gateway gw/a: Accepted=True (Accepted), ResolvedRefs=False (ResolvedRefs)")),
    (None, {"InferencePool"}, ("False", "Forbidden", "the operator may not manage InferencePool objects: install "
                                                     "the chart with rbac.inferencePool=true (and the InferencePool "
                                                     "CRD)")),
], ids=["missing", "no-parents", "accepted", "one-of-two", "unresolved", "forbidden"])
def test_status_copies_the_pools_parent_conditions(pool: Any, forbidden: set[str],
                                                   expected: tuple[str, str, str]) -> None:
    svc = _example()
    cond = S.inference_pool_condition(svc, {POOL_KEY: pool}, forbidden)
    assert cond == {"type": "InferencePoolReady", "status": expected[0], "reason": expected[1],
                    "message": expected[2]}


def test_ready_waits_for_the_picker_and_the_pool() -> None:
    svc = _example()
    ready = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                                                       "availableReplicas": 2, "updatedReplicas": 2}}
    observed: S.Observed = {("apps/v1", "Deployment", "smol-pool-engine"): ready,
                            ("apps/v1", "Deployment", "smol-pool-redis"): ready,
                            ("apps/v1", "Deployment", "smol-pool-epp"): ready}
    st = S.build_status(svc, observed, 2, 1, None, NOW)
    assert [(c["type"], c["status"], c["reason"]) for c in st["conditions"]] == [
        ("EnginesReady", "True", "MinimumReplicasAvailable"), ("RouterReady", "True", "MinimumReplicasAvailable"),
        ("RedisReady", "True", "MinimumReplicasAvailable"), ("IngressReady", "True", "Disabled"),
        ("InferencePoolReady", "False", "InferencePoolMissing"), ("Ready", "False", "InferencePoolNotReady")]
    assert st["conditions"][1]["message"] == "2 endpoint picker pod(s) ready"
    observed[POOL_KEY] = _pool_status(_parent("inference-gateway", "True", "True"))
    st = S.build_status(svc, observed, 2, 1, None, NOW)
    assert (st["phase"], st["conditions"][-1]["reason"]) == ("Ready", "AllComponentsReady")
