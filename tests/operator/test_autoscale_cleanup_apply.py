"""The autoscaler's decision, the metrics parser and the patch builder (all pure)."""
from __future__ import annotations

import pytest

from typing import Any

from kvmesh.operator import autoscale, crd
from kvmesh.operator.apply import (APPLIED_HASH, RESTARTED_AT, decide, desired_hash, fingerprint_key,
                                   fingerprints_update, live_fingerprint, patch_ops)

SPEC = crd.AutoscalingSpec(enabled=True, mode="operator", min_replicas=1, max_replicas=6,
                           target_waiting_requests=4, cooldown_seconds=60, prometheus_address=None)


def test_decide_scales_up_to_the_target_per_pod() -> None:
    assert autoscale.decide(SPEC, 1, [10.0], None) == autoscale.Decision(
        3, True, "10 waiting over 1 pod(s), target 4/pod: 1 → 3")


def test_decide_clamps_to_max_and_min() -> None:
    assert autoscale.decide(SPEC, 2, [40.0, 40.0], 100.0).replicas == 6
    assert autoscale.decide(SPEC, 3, [0.0, 0.0, 0.0], 100.0) == autoscale.Decision(
        1, True, "0 waiting over 3 pod(s), target 4/pod: 3 → 1")


def test_decide_respects_the_cooldown() -> None:
    assert autoscale.decide(SPEC, 1, [20.0], 30.0) == autoscale.Decision(
        1, False, "cooling down (30s < 60s), would scale to 5")


def test_decide_holds_without_metrics_and_when_steady() -> None:
    assert autoscale.decide(SPEC, 2, [], 100.0) == autoscale.Decision(2, False, "no engine pod reported metrics")
    assert autoscale.decide(SPEC, 2, [4.0, 3.0], 100.0).changed is False
    # a non-empty queue never scales below the pods already busy
    assert autoscale.decide(SPEC, 4, [1.0, 0.0, 0.0, 0.0], 100.0).replicas == 4


def test_parse_waiting_prefers_the_kvmesh_gauge() -> None:
    page = ("# HELP kvmesh:num_requests_waiting Requests waiting\n"
            "# TYPE kvmesh:num_requests_waiting gauge\n"
            'kvmesh:num_requests_waiting{model_name="smol"} 3.0\n'
            'vllm:num_requests_waiting{model_name="smol"} 3.0\n'
            'vllm:num_requests_running{model_name="smol"} 8.0\n')
    assert autoscale.parse_waiting(page) == 3.0
    assert autoscale.parse_waiting('vllm:num_requests_waiting{model_name="a"} 2\n') == 2.0
    assert autoscale.parse_waiting("") == 0.0


def test_patch_ops_keep_foreign_annotations_and_hpa_replicas() -> None:
    desired = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "d", "namespace": "n", "labels": {"a": "b"}, "ownerReferences": [],
                            "annotations": {APPLIED_HASH: "h"}},
               "spec": {"template": {}}}
    live = {"metadata": {"annotations": {"deployment.kubernetes.io/revision": "3"}}, "spec": {"replicas": 4}}
    assert patch_ops(desired, live) == [
        {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}},
        {"op": "add", "path": "/metadata/ownerReferences", "value": []},
        {"op": "add", "path": "/metadata/annotations/kvmesh.io~1applied-hash", "value": "h"},
        {"op": "add", "path": "/spec", "value": {"replicas": 4, "template": {}}}]
    assert desired_hash(desired) == desired_hash(dict(desired))


def _deployment(spec: dict[str, Any], digest: str = "h", **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "n", "annotations": {APPLIED_HASH: digest}, **meta},
            "spec": spec, "status": {"readyReplicas": 1}}


TEMPLATE = {"metadata": {"annotations": {"a": "1"}},
            "spec": {"containers": [{"name": "engine", "image": "kvmesh:1", "terminationMessagePath": "/dev/x"}]}}


def test_the_fingerprint_covers_owned_fields_only() -> None:
    desired = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"replicas": 2, "template": {}}}
    live = _deployment({"replicas": 2, "template": TEMPLATE})
    fp = live_fingerprint(desired, live)
    assert fp == desired_hash({"spec": {"replicas": 2, "template": TEMPLATE}})
    # metadata and status belong to others
    assert live_fingerprint(desired, {**_deployment({"replicas": 2, "template": TEMPLATE}, revision="9"),
                                      "status": {}}) == fp
    # an edited image or replica count does not match
    edited = {"metadata": TEMPLATE["metadata"], "spec": {"containers": [{**TEMPLATE["spec"]["containers"][0],
                                                                         "image": "evil:1"}]}}
    assert live_fingerprint(desired, _deployment({"replicas": 2, "template": edited})) != fp
    assert live_fingerprint(desired, _deployment({"replicas": 5, "template": TEMPLATE})) != fp
    # `kubectl rollout restart` does not count as an edit
    restarted = {**TEMPLATE, "metadata": {"annotations": {"a": "1", RESTARTED_AT: "2025-01-01T00:00:00Z"}}}
    assert live_fingerprint(desired, _deployment({"replicas": 2, "template": restarted})) == fp


def test_the_fingerprint_ignores_replicas_an_hpa_owns() -> None:
    desired = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {}}}
    fp = live_fingerprint(desired, _deployment({"replicas": 1, "template": TEMPLATE}))
    assert fp == desired_hash({"spec": {"template": TEMPLATE}})
    assert live_fingerprint(desired, _deployment({"replicas": 7, "template": TEMPLATE})) == fp


def test_the_fingerprint_of_a_config_map_is_its_data() -> None:
    desired = {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"engine.json": "{}"}}
    live = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "resourceVersion": "3"},
            "data": {"engine.json": "{}"}}
    assert live_fingerprint(desired, live) == desired_hash({"data": {"engine.json": "{}"}})
    assert live_fingerprint(desired, {**live, "data": {"engine.json": "[]"}}) != live_fingerprint(desired, live)


def test_decide() -> None:
    desired = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"replicas": 2, "template": {}}}
    live = _deployment({"replicas": 2, "template": TEMPLATE}, digest="h1")
    fp = live_fingerprint(desired, live)
    assert decide(desired, "h1", None, fp) == "create"
    assert decide(desired, "h1", {**live, "metadata": {**live["metadata"], "deletionTimestamp": "t"}}, fp) == "wait"
    assert decide(desired, "h2", live, fp) == "patch"  # the desired form changed
    assert decide(desired, "h1", live, None) == "patch"  # nothing recorded: reassert once
    assert decide(desired, "h1", live, fp) == "keep"
    assert decide(desired, "h1", _deployment({"replicas": 5, "template": TEMPLATE}, digest="h1"), fp) == "revert"


def test_fingerprints_update_drops_children_gone() -> None:
    assert fingerprint_key({"kind": "Service", "metadata": {"name": "smol"}}) == "Service/smol"
    assert fingerprints_update({"Service/a": "1", "Ingress/a": "2"}, {"Service/a": "3", "ConfigMap/c": "4"}) == {
        "Ingress/a": None, "Service/a": "3", "ConfigMap/c": "4"}


def test_patch_ops_keep_a_rollout_restart() -> None:
    desired = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "d", "namespace": "n", "labels": {}, "ownerReferences": [],
                            "annotations": {APPLIED_HASH: "h"}},
               "spec": {"replicas": 2, "template": {"metadata": {"annotations": {"a": "1"}}, "spec": {}}}}
    live = {"metadata": {}, "spec": {"replicas": 3, "template": {"metadata": {"annotations": {
        "a": "0", RESTARTED_AT: "2025-01-01T00:00:00Z"}}}}}
    assert patch_ops(desired, live)[-1] == {"op": "add", "path": "/spec", "value": {
        "replicas": 2, "template": {"metadata": {"annotations": {"a": "1", RESTARTED_AT: "2025-01-01T00:00:00Z"}},
                                    "spec": {}}}}


def test_only_a_403_on_an_optional_kind_is_tolerated() -> None:
    from kvmesh.operator.handlers import is_forbidden_optional
    from kvmesh.operator.kube import KubeError
    assert is_forbidden_optional(KubeError(403, "forbidden"), "ScaledObject") is True
    assert is_forbidden_optional(KubeError(403, "forbidden"), "HorizontalPodAutoscaler") is True
    assert is_forbidden_optional(KubeError(403, "forbidden"), "Deployment") is False
    assert is_forbidden_optional(KubeError(500, "boom"), "ScaledObject") is False


@pytest.mark.parametrize("url", ["unix:///var/run/redis.sock", "http://evil.example/", "file:///etc/passwd"])
def test_cleanup_refuses_other_transports_before_connecting(url: str) -> None:
    from kvmesh.operator import redis_cleanup
    with pytest.raises(ValueError, match="only redis:// and rediss://"):
        redis_cleanup.cleanup(url, "s3cr3t", "ns", "svc")


@pytest.mark.parametrize(("namespace", "name"), [("team-a", "../../kube-system/secrets/x"), ("team-a", "other/x"),
                                                 ("team-a", "a..b"), ("kube-system/x", "y"), ("team-a", "%2Fx")])
def test_object_paths_never_leave_the_namespace(namespace: str, name: str) -> None:
    from kvmesh.operator.kube import object_path
    with pytest.raises(ValueError):
        object_path("v1", "Secret", namespace, name)
    assert object_path("v1", "Secret", "team-a", "redis-auth") == "/api/v1/namespaces/team-a/secrets/redis-auth"
