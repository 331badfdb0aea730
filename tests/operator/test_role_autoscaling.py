"""Per-role autoscaling of spec.disaggregation (role_autoscaling.py): each role's HPA or KEDA
ScaledObject on its own metrics (prefill: waiting requests; decode: running requests and KV-cache
use), its validation in both the operator and the CRD's CEL rules, and the real operator against
kmock switching a role from an HPA to a ScaledObject."""
from __future__ import annotations

from typing import Any

import pytest

from kvmesh.operator import crd
from kvmesh.operator import resources as R
from kvmesh.operator import role_autoscaling as RA

from .conftest import NAMESPACE, StampingEmulator, obj, wait_for
from .test_crd_cel import _cr as _cel_cr
from .test_crd_cel import failures
from .test_e2e_kmock import _cond, _cr, _create, _post

OWNER = R.Owner("pd", "uid-1")
PROM = "http://prometheus.monitoring:9090"


def _svc(prefill: dict[str, Any], decode: dict[str, Any], engine: dict[str, Any] | None = None) -> crd.InferenceService:
    return crd.parse("pd", "ns", {"model": {}, "gpu": {"count": 0}, "engine": engine or {}, "disaggregation": {
        "prefill": {"autoscaling": prefill}, "decode": {"autoscaling": decode}}})


def _kids(svc: crd.InferenceService) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in R.build_children(svc, OWNER, R.engine_replicas(svc, None))}


def test_each_role_gets_an_hpa_on_its_own_metrics():
    svc = _svc({"enabled": True, "maxReplicas": 3, "targetWaitingRequests": 2},
               {"enabled": True, "minReplicas": 2, "maxReplicas": 8, "targetRunningRequests": 24,
                "targetKVCacheUsagePercent": 80, "cooldownSeconds": 120})
    kids = _kids(svc)
    prefill, decode = kids[("HorizontalPodAutoscaler", "pd-prefill")], kids[("HorizontalPodAutoscaler", "pd-decode")]
    assert prefill["metadata"]["labels"]["kvmesh.io/role"] == "prefill"
    assert prefill["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pd-prefill"},
        "minReplicas": 1, "maxReplicas": 3,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": "kvmesh_num_requests_waiting"},
                                              "target": {"type": "AverageValue", "averageValue": "2"}}}],
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}, "scaleUp": {"stabilizationWindowSeconds": 0}}}
    assert decode["spec"]["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": "kvmesh_num_requests_running"},
                                  "target": {"type": "AverageValue", "averageValue": "24"}}},
        {"type": "Pods", "pods": {"metric": {"name": "kvmesh_kv_cache_usage_perc"},
                                  "target": {"type": "AverageValue", "averageValue": "800m"}}}]
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"],
            decode["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]) == (2, 8, 120)
    # both Deployments leave their replicas to the autoscalers; no ScaledObject in hpa mode
    assert "replicas" not in kids[("Deployment", "pd-prefill")]["spec"]
    assert "replicas" not in kids[("Deployment", "pd-decode")]["spec"]
    assert not any(kind == "ScaledObject" for kind, _ in kids)


def test_a_decode_role_without_targets_scales_on_a_full_batch_per_pod():
    svc = _svc({}, {"enabled": True}, engine={"maxNumSeqs": 48})
    a = svc.disaggregation.decode.autoscaling
    assert (a.target_waiting_requests, a.target_running_requests, a.target_kv_cache_usage_percent) == (None, 48, None)
    assert RA.role_targets(svc, svc.disaggregation.decode) == [("num_requests_running", 48)]
    # prefill keeps its queue target (4 by default) whatever else it sets
    assert RA.role_targets(svc, svc.disaggregation.prefill) == [("num_requests_waiting", 4)]
    assert ("HorizontalPodAutoscaler", "pd-prefill") not in _kids(svc)      # not enabled: fixed replicas


def test_keda_mode_builds_a_scaled_object_on_the_roles_pods_only():
    svc = _svc({"enabled": True, "mode": "keda", "prometheusAddress": PROM, "maxReplicas": 5},
               {"enabled": True, "mode": "keda", "prometheusAddress": PROM, "targetRunningRequests": 16,
                "targetKVCacheUsagePercent": 75})
    kids = _kids(svc)
    assert not any(kind == "HorizontalPodAutoscaler" for kind, _ in kids)
    so = kids[("ScaledObject", "pd-decode")]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["labels"]["kvmesh.io/role"] == "decode"
    where = '{namespace="ns",model_name="pd",pod=~"pd-decode-[a-z0-9]+-[a-z0-9]+"}'
    assert so["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pd-decode"},
        "minReplicaCount": 1, "maxReplicaCount": 4,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 300}, "scaleUp": {"stabilizationWindowSeconds": 0}}}},
        "pollingInterval": 15,
        "triggers": [
            {"type": "prometheus", "name": "num-requests-running", "metadata": {
                "serverAddress": PROM, "query": f"sum(vllm:num_requests_running{where})", "threshold": "16"}},
            {"type": "prometheus", "name": "kv-cache-usage-perc", "metadata": {
                "serverAddress": PROM, "query": f"sum(vllm:kv_cache_usage_perc{where})", "threshold": "0.75"}}]}
    (trigger,) = kids[("ScaledObject", "pd-prefill")]["spec"]["triggers"]
    assert trigger["metadata"]["query"] == ('sum(vllm:num_requests_waiting{namespace="ns",model_name='
                                            '"pd",pod=~"pd-prefill-[a-z0-9]+-[a-z0-9]+"})')
    assert kids[("ScaledObject", "pd-prefill")]["spec"]["maxReplicaCount"] == 5


@pytest.mark.parametrize(("autoscaling", "problem", "cel"), [
    ({"enabled": True, "mode": "keda"},
     "spec.disaggregation.decode.autoscaling.prometheusAddress is required when its mode is keda",
     ["disaggregation.decode.autoscaling.prometheusAddress is required when its mode is keda"]),
    ({"enabled": True, "mode": "operator"},
     "spec.disaggregation.decode.autoscaling.mode must be one of hpa, keda, got 'operator'", []),
    ({"targetKVCacheUsagePercent": 101},
     "spec.disaggregation.decode.autoscaling.targetKVCacheUsagePercent must be <= 100, got 101", []),
])
def test_bad_role_autoscaling_is_refused_naming_the_field(autoscaling, problem, cel):
    spec = {"model": {}, "disaggregation": {"decode": {"autoscaling": autoscaling}}}
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", spec)
    assert err.value.problems == [problem]
    assert failures(_cel_cr(spec)) == cel        # enums and bounds are the schema's, not CEL's


def test_autoscaling_ready_names_each_autoscaled_role():
    svc = _svc({"enabled": True, "maxReplicas": 3},
               {"enabled": True, "mode": "keda", "prometheusAddress": PROM, "minReplicas": 2, "maxReplicas": 8})
    hpa = ("autoscaling/v2", "HorizontalPodAutoscaler", "pd-prefill")
    so = ("keda.sh/v1alpha1", "ScaledObject", "pd-decode")
    assert RA.role_autoscaling_condition(svc, {hpa: {}, so: {}}, frozenset()) == {
        "type": "AutoscalingReady", "status": "True", "reason": "Managed",
        "message": "prefill: HorizontalPodAutoscaler pd-prefill scales the prefill pods within 1-3; "
                   "decode: ScaledObject pd-decode scales the decode pods within 2-8"}
    assert RA.role_autoscaling_condition(svc, {so: {}}, frozenset()) == {
        "type": "AutoscalingReady", "status": "False", "reason": "HorizontalPodAutoscalerMissing",
        "message": "prefill: the HorizontalPodAutoscaler does not exist yet; "
                   "decode: ScaledObject pd-decode scales the decode pods within 2-8"}
    # the chart without rbac.keda: the API server refuses ScaledObjects (403)
    forbidden = RA.role_autoscaling_condition(svc, {hpa: {}}, frozenset({"ScaledObject"}))
    assert (forbidden["status"], forbidden["reason"]) == ("False", "Forbidden")
    assert forbidden["message"].endswith("decode: the operator may not manage ScaledObject objects: install the "
                                         "chart with rbac.keda=true; the decode pods run unscaled")
    # it is the service's condition, and it holds Ready back
    from kvmesh.operator import status as S
    conds = {c["type"]: c for c in S.conditions(svc, {so: {}}, 0, frozenset())}
    assert conds["AutoscalingReady"]["reason"] == "HorizontalPodAutoscalerMissing"
    assert conds["Ready"]["status"] == "False"
    # no role autoscales (or a colocated service): no such condition
    assert RA.role_autoscaling_condition(_svc({}, {}), {}, frozenset()) is None
    assert RA.role_autoscaling_condition(crd.parse("pd", "ns", {"model": {}}), {}, frozenset()) is None


# ---- the real operator against kmock ---------------------------------------------------------------
@pytest.mark.kmock(cls=StampingEmulator)
@pytest.mark.timeout(60)
async def test_the_operator_swaps_a_roles_hpa_for_a_scaled_object(cluster: Any) -> None:
    server = cluster
    await _create(server, "pd", {"model": {}, "gpu": {"count": 0}, "disaggregation": {
        "prefill": {"autoscaling": {"enabled": True, "targetWaitingRequests": 3}},
        "decode": {"autoscaling": {"enabled": True, "targetRunningRequests": 20}}}})
    hpa = await wait_for(lambda: obj(server, "autoscaling/v2/horizontalpodautoscalers", "pd-decode"),
                         what="decode HPA")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kvmesh_num_requests_running"
    prefill = await wait_for(lambda: obj(server, "autoscaling/v2/horizontalpodautoscalers", "pd-prefill"),
                             what="prefill HPA")
    assert prefill["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "3"

    await _post(server, f"/apis/kvmesh.io/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/pd",
                {"spec": {"disaggregation": {"decode": {"autoscaling": {"mode": "keda",
                                                                        "prometheusAddress": PROM}}}}},
                method="patch", content_type="application/merge-patch+json")
    so = await wait_for(lambda: obj(server, "keda.sh/v1alpha1/scaledobjects", "pd-decode"), what="ScaledObject")
    assert so["spec"]["triggers"][0]["metadata"]["threshold"] == "20"
    await wait_for(lambda: obj(server, "autoscaling/v2/horizontalpodautoscalers", "pd-decode") is None,
                   what="the decode HPA deleted")
    assert obj(server, "autoscaling/v2/horizontalpodautoscalers", "pd-prefill") is not None
    await wait_for(lambda: _cond(_cr(server, "pd"), "AutoscalingReady").get("message") == (
        "prefill: HorizontalPodAutoscaler pd-prefill scales the prefill pods within 1-4; "
        "decode: ScaledObject pd-decode scales the decode pods within 1-4"), what="AutoscalingReady")
