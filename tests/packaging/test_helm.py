"""The chart renders (default and full values), validates against the Kubernetes schemas, enforces
its values.schema.json, lints clean, documents every value, and grants exactly what the operator uses."""
from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvmesh.operator import crd
from kvmesh.operator import resources as R
from kvmesh.operator.schema import crd_manifest, crd_yaml

from .render import CHART, MANIFESTS, render

K8S_VERSION = "1.32.0"
FULL = {
    "image": {"repository": "registry.example.com/kvmesh", "tag": "0.1.0", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"watchNamespaces": ["llm", "team-a"], "resyncSeconds": 30, "verbose": True, "livenessPort": 9090,
                 "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                     {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}},
                 "podAnnotations": {"example.com/team": "ml"}, "priorityClassName": "system-cluster-critical"},
    "serviceAccount": {"create": True, "name": "kvmesh-operator", "annotations": {"example.com/role": "op"}},
    "rbac": {"create": True, "hpa": True, "keda": True, "readSecrets": False, "watchSecrets": False,
             "inferencePool": True},
    "inferenceServices": [{"name": "llama", "namespace": "llm", "spec": {
        "model": {"source": "pvc", "pvc": {"claimName": "llama-weights", "path": "Llama-3.1-8B-Instruct"}},
        "gpu": {"count": 2}, "engine": {"sharedMemorySize": "16Gi", "nccl": {"socketIfname": "eth0"}}}}],
    "redis": {"enabled": True, "image": {"repository": "redis", "tag": "7.4.1-alpine"}, "maxMemory": "2gb",
              "resources": {"requests": {"cpu": "200m", "memory": "1Gi"}, "limits": {"memory": "3Gi"}}},
}


def _kinds(objects: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    return sorted((o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects)


def _validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "InferenceService":  # our CRD: its own schema (jsonschema), the built-in kinds: OpenAPI
        schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        jsonschema.Draft4Validator(schema).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values", [None, FULL], ids=["default", "full"])
def test_rendered_objects_are_valid_kubernetes(values: dict[str, Any] | None) -> None:
    for obj in render(values):
        _validate(obj)
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvmesh"
        assert labels["app.kubernetes.io/instance"] == "kvmesh"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"


def test_default_render() -> None:
    objects = render()
    assert _kinds(objects) == [
        ("ClusterRole", "kvmesh", None), ("ClusterRole", "kvmesh-discovery", None),
        ("ClusterRoleBinding", "kvmesh", None), ("ClusterRoleBinding", "kvmesh-discovery", None),
        ("Deployment", "kvmesh-operator", "kvmesh-system"), ("ServiceAccount", "kvmesh", "kvmesh-system")]
    (dep,) = [o for o in objects if o["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/kvmesh/kvmesh:0.1.0"
    assert c["args"] == ["operator", "--standalone", "--liveness=http://0.0.0.0:8080/healthz",
                         "--resync-seconds=15", "--all-namespaces"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_full_render() -> None:
    objects = render(FULL)
    assert _kinds(objects) == [
        ("ClusterRole", "kvmesh-discovery", None), ("ClusterRoleBinding", "kvmesh-discovery", None),
        ("Deployment", "kvmesh-operator", "kvmesh-system"), ("Deployment", "kvmesh-redis", "kvmesh-system"),
        ("InferenceService", "llama", "llm"), ("Role", "kvmesh", "llm"), ("Role", "kvmesh", "team-a"),
        ("RoleBinding", "kvmesh", "llm"), ("RoleBinding", "kvmesh", "team-a"),
        ("Service", "kvmesh-redis", "kvmesh-system"), ("ServiceAccount", "kvmesh-operator", "kvmesh-system")]
    dep = next(o for o in objects if o["metadata"]["name"] == "kvmesh-operator")
    # the two-GPU model: the operator reads the same spec (tensor parallelism over both GPUs)
    llama = next(o for o in objects if o["kind"] == "InferenceService")
    svc = crd.parse(llama["metadata"]["name"], llama["metadata"]["namespace"], llama["spec"])
    assert (svc.gpu.count, svc.engine.tensor_parallel_size, svc.engine.shared_memory_size) == (2, 2, "16Gi")
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["operator", "--standalone", "--liveness=http://0.0.0.0:9090/healthz",
                                            "--resync-seconds=30", "--namespace=llm", "--namespace=team-a",
                                            "--verbose"]
    assert pod["serviceAccountName"] == "kvmesh-operator"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    role = next(o for o in objects if o["kind"] == "Role")
    groups = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert ("keda.sh", "scaledobjects") in groups
    (secrets,) = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secrets["verbs"] == ["create"]  # readSecrets: false
    redis = next(o for o in objects if o["metadata"]["name"] == "kvmesh-redis" and o["kind"] == "Deployment")
    assert "2gb" in redis["spec"]["template"]["spec"]["containers"][0]["args"]


def test_images_are_pinned() -> None:
    for values in (None, FULL):
        for obj in render(values):
            for c in (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
                repo, _, tag = c["image"].rpartition(":")
                assert repo and tag and tag != "latest", c["image"]


@pytest.mark.parametrize(("values", "needle"), [
    ({"image": {"repository": "x", "tag": "latest"}}, "tag"),
    ({"operator": {"resyncSeconds": 0}}, "resyncSeconds"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces"),
    ({"rbac": {"keda": "yes"}}, "keda"),
    ({"surprise": True}, "surprise"),
])
def test_values_schema_refuses_bad_values(values: dict[str, Any], needle: str) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as err:
            chart.validate_schema(chart.merge_values(values))
    assert needle in str(err.value)


def test_values_schema_accepts_default_and_full_values() -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(None))
        chart.validate_schema(chart.merge_values(FULL))


def test_lint_is_clean() -> None:
    for values in (None, FULL):
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w]*):\s*(\S.*)?$", line)
        if not m or m.group(2) in ("requests", "limits", "cpu", "memory"):
            continue  # resource quantities are documented by their parent
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        is_leaf = m.group(3) is not None
        if is_leaf and not (j >= 0 and lines[j].strip().startswith("# --")):
            undocumented.append(m.group(2))
    assert undocumented == []


def test_crd_is_one_source_of_truth() -> None:
    chart_crd = (CHART / "crds" / "inferenceservices.yaml").read_text()
    assert chart_crd == (MANIFESTS / "crd.yaml").read_text() == crd_yaml(), \
        "regenerate: python -m kvmesh.operator.schema > manifests/crd.yaml (and helm/kvmesh/crds/)"
    with helm.Chart.load(CHART) as chart:
        assert [c["name"] for c in chart.crds] == ["crds/inferenceservices.yaml"]
    kubernetes_validate.validate(yaml.safe_load(chart_crd), K8S_VERSION, strict=True)


def _rules(values: dict[str, Any] | None) -> dict[tuple[str, str], set[str]]:
    role = next(o for o in render(values) if o["kind"] in ("ClusterRole", "Role")
                and not o["metadata"]["name"].endswith("-discovery"))
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                out.setdefault((g, r), set()).update(rule["verbs"])
    return out


def test_rbac_grants_exactly_what_the_operator_uses() -> None:
    from kvmesh.operator.inference_pool import EPP_RULES
    from kvmesh.operator.kube import _PLURALS
    svc = crd.parse("x", "ns", {"model": {}})
    managed = {(api.rpartition("/")[0], _PLURALS[kind]) for api, kind, _ in R.possible_children(svc)}
    rules = _rules({"rbac": {"keda": True, "inferencePool": True}})
    for key in managed:
        assert {"get", "create", "patch", "delete"} <= rules[key], key
    # the endpoint picker's Role: the operator holds every right it grants (the API server's escalation check)
    for rule in EPP_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= rules[(group, resource)], (group, resource)
    assert rules == {
        **{k: {"get", "create", "patch", "delete"} for k in managed},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch", "create", "patch", "delete"},
        ("inference.networking.x-k8s.io", "inferenceobjectives"): {"get", "list", "watch"},
        ("kvmesh.io", "inferenceservices"): {"get", "list", "watch", "patch"},
        ("kvmesh.io", "inferenceservices/status"): {"get", "patch"},
        ("kvmesh.io", "inferenceservices/finalizers"): {"update"},
        ("", "pods"): {"get", "list", "watch"}, ("", "events"): {"create"}, ("", "secrets"): {"create"}}
    # without rbac.inferencePool: none of the pool's kinds, pods only listed (the autoscaler)
    plain = _rules(None)
    assert not {("inference.networking.k8s.io", "inferencepools"), ("", "serviceaccounts"),
                ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings")} & set(plain)
    assert plain[("", "pods")] == {"list"}
    assert _rules({"rbac": {"readSecrets": True}})[("", "secrets")] == {"get", "create"}
    assert _rules({"rbac": {"watchSecrets": True}})[("", "secrets")] == {"get", "list", "watch", "create"}


def test_watch_secrets_runs_the_operator_with_the_secret_watch() -> None:
    def args(values: dict[str, Any] | None) -> list[str]:
        dep = next(o for o in render(values) if o["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--watch-secrets" not in args(None)
    assert args({"rbac": {"watchSecrets": True}})[-1] == "--watch-secrets"
    assert "--watch-secrets" not in args({"rbac": {"create": False, "watchSecrets": True}})


def test_no_secret_is_readable_cluster_wide_by_default() -> None:
    """The finalizer reads a user-named Secret: by default the operator may not read any (create only)."""
    for obj in render():
        for rule in obj.get("rules", []):
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["create"], (obj["kind"], rule)
    reading = [o["kind"] for o in render({"rbac": {"readSecrets": True}}) for rule in o.get("rules", [])
               if "secrets" in rule["resources"] and "get" in rule["verbs"]]
    assert reading == ["ClusterRole"]  # only when asked for
    namespaced = [(o["kind"], o["metadata"]["namespace"]) for o in render(
        {"rbac": {"readSecrets": True}, "operator": {"watchNamespaces": ["llm"]}})
        for rule in o.get("rules", []) if "secrets" in rule["resources"] and "get" in rule["verbs"]]
    assert namespaced == [("Role", "llm")]


def test_the_operator_knows_its_namespace() -> None:
    dep = next(o for o in render() if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["env"] == [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    assert R.OPERATOR_POD_LABELS.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # no wildcards anywhere
    for obj in render(FULL):
        for rule in obj.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
