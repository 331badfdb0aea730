"""The autoscaler's decision, the metrics parser, Redis key cleanup and the patch builder (all pure)."""
from __future__ import annotations

from typing import Any

from kvmesh.operator import autoscale, crd, redis_cleanup
from kvmesh.operator.apply import APPLIED_HASH, desired_hash, patch_ops

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


class FakeRedis:
    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)
        self.deletes: list[int] = []

    def scan_iter(self, match: str, count: int) -> Any:
        import fnmatch
        assert match == "kvmesh:team-a/smol:*"
        return iter(sorted(k for k in self.keys if fnmatch.fnmatchcase(k, match)))

    def delete(self, *keys: str) -> int:
        self.deletes.append(len(keys))
        self.keys -= set(keys)
        return len(keys)


def test_delete_keys_removes_only_the_services_prefix_in_batches() -> None:
    mine = [f"kvmesh:team-a/smol:block:{i}" for i in range(5)]
    others = ["kvmesh:team-a/smol2:block:0", "kvmesh:team-b/smol:block:0", "other"]
    fake = FakeRedis(mine + others)
    assert redis_cleanup.delete_keys(fake, "team-a", "smol", batch=2) == 5
    assert fake.deletes == [2, 2, 1]
    assert fake.keys == set(others)


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


def test_only_a_403_on_an_optional_kind_is_tolerated() -> None:
    from kvmesh.operator.handlers import is_forbidden_optional
    from kvmesh.operator.kube import KubeError
    assert is_forbidden_optional(KubeError(403, "forbidden"), "ScaledObject") is True
    assert is_forbidden_optional(KubeError(403, "forbidden"), "HorizontalPodAutoscaler") is True
    assert is_forbidden_optional(KubeError(403, "forbidden"), "Deployment") is False
    assert is_forbidden_optional(KubeError(500, "boom"), "ScaledObject") is False
